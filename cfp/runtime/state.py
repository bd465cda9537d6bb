"""Between the layout-independent training state (the full ``{"params": ...}`` tree and its optax
state, as host numpy) and the per-stage device copies a pipeline layout holds."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np


def subtree(params: dict, names) -> dict:
    """``{"params": {name: ...}}`` restricted to the submodules ``names``."""
    return {"params": {n: params["params"][n] for n in names}}


def path_table(tree: Any) -> dict[str, Any]:
    """``{keystr(path): leaf}`` of a pytree."""
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def first_wins(tables) -> dict[str, Any]:
    """The union of ``tables``; a key in several takes the first table's value."""
    out: dict[str, Any] = {}
    for t in tables:
        out.update({k: v for k, v in t.items() if k not in out})
    return out


def place_opt_state(opt_state: Any, opt_shardings: Any) -> Any:
    """A stage's optax state from the full one: the stage's state has the full state's leaves at the
    same key paths, so each leaf is looked up by path and placed on the stage's sharding."""
    table = path_table(opt_state)
    flat, treedef = jax.tree_util.tree_flatten_with_path(opt_shardings)
    # from host copies: the update donates these buffers (see StageProgram.place_params)
    leaves = [jax.device_put(np.array(table[jax.tree_util.keystr(p)], copy=True), sh) for p, sh in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def collect(like: Any, table: dict[str, Any]) -> Any:
    """Host numpy tree shaped like ``like`` from ``{keystr(path): array}``; in a multi-process run,
    leaves missing here come from the lowest-numbered process that has them."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    keys = [jax.tree_util.keystr(p) for p, _ in flat]
    leaves = [np.asarray(jax.device_get(table[k])) if k in table else np.zeros(l.shape, l.dtype)
              for k, (_, l) in zip(keys, flat)]
    if jax.process_count() > 1:
        have = np.array([k in table for k in keys], np.int32)
        flags, gathered = process_allgather((have, leaves))
        owner = np.argmax(np.asarray(flags), axis=0)  # first process holding each leaf
        leaves = [np.asarray(g)[owner[i]] for i, g in enumerate(gathered)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def process_allgather(x: Any) -> Any:
    """Every process's copy of the (host) pytree ``x``, stacked on a new leading axis."""
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(x)
