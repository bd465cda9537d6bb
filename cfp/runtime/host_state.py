"""Between the layout-independent training state (the model's full parameter tree and its optax state, as host
numpy, in the model's own structure) and the per-stage device copies a pipeline layout holds."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from cfp.runtime.cliques import meet_before_first_collective


def host(tree: Any) -> Any:
    """A host numpy copy of a (possibly sharded) device tree."""
    return jax.tree_util.tree_map(lambda a: np.asarray(jax.device_get(a)), tree)


def gather_stages(keys: Sequence[tuple[int, int]], held: dict, like_of: Callable[[tuple[int, int]], Any],
                  local: Callable[[tuple[int, int]], bool]) -> list:
    """Host copies of stage ``keys``' trees (``held[key]`` on the process running the stage); in a multi-process
    run each is broadcast from its process, so every process gets all of them."""
    out = []
    if jax.process_count() > 1:
        meet_before_first_collective(jax.devices())
    for key in keys:
        mine = local(key)
        value = host(held[key]) if mine else jax.tree_util.tree_map(
            lambda l: np.zeros(l.shape, l.dtype), like_of(key))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            value = jax.tree_util.tree_map(np.asarray, multihost_utils.broadcast_one_to_all(value, is_source=mine))
        out.append(value)
    return out


def process_allgather(x: Any) -> Any:
    """Every process's copy of the (host) pytree ``x``, stacked on a new leading axis."""
    from jax.experimental import multihost_utils
    meet_before_first_collective(jax.devices())
    return multihost_utils.process_allgather(x)
