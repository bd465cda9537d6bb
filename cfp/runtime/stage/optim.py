"""A stage's share of the user's optimizer: cut the full optimizer state into a stage's part, run the stage's
update, merge the parts back.

INTERIM: the update runs the transformation on the stage's own parameters, which equals the whole-model update
for transformations that treat every parameter alone (AdamW, SGD, Lion, ...); the partition of an arbitrary
transformation (global norms across stages) replaces it.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
import optax

from cfp.layered.model import LayeredModel, stage_params
from cfp.layout import PlacedStage

_LAYER = re.compile(r"\['layers'\]\[(\d+)\]")


class ModelOptimizer:
    """The optimizer of a whole `LayeredModel`, split by stage."""

    def __init__(self, tx: optax.GradientTransformation, model: LayeredModel):
        self.tx, self.model = tx, model
        self.params_like = model.abstract().params
        self.like = jax.eval_shape(tx.init, self.params_like)
        self.has_globals = False
        self.globals_like = ()

    def stage(self, st: PlacedStage) -> "StageOptimizer":
        return StageOptimizer(self, st)

    def combine(self, partials: Sequence[Any]) -> Any:
        return ()

    def merge(self, parts: Sequence[Any], stages: Sequence[PlacedStage]) -> Any:
        """The full optimizer state (host numpy) from one pipeline's stage states, in stage order."""
        table: dict[str, Any] = {}
        pieces: dict[str, list] = {}
        for part, st in zip(parts, stages):
            so = self.stage(st)
            for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]:
                key, sliced = so.full_key(jax.tree_util.keystr(path))
                if sliced:
                    pieces.setdefault(key, []).append(np.asarray(leaf))
                else:
                    table.setdefault(key, np.asarray(leaf))
        for key, ps in pieces.items():
            table[key] = np.concatenate(ps, axis=0)
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.like)
        return jax.tree_util.tree_unflatten(treedef, [table[jax.tree_util.keystr(p)] for p, _ in flat])


class StageOptimizer:
    """One stage's part: its state's structure, how to cut it from the full state, its update."""

    def __init__(self, model_opt: ModelOptimizer, st: PlacedStage):
        self.model_opt, self.stage = model_opt, st
        m = model_opt.model
        self.params_like = stage_params(model_opt.params_like, st.layer_start, st.layer_end, st.is_first,
                                        st.is_last, m.stacked)
        self.like = jax.eval_shape(model_opt.tx.init, self.params_like)
        self.has_globals = False
        self.globals_like = ()
        full = {jax.tree_util.keystr(p): l for p, l in jax.tree_util.tree_flatten_with_path(model_opt.like)[0]}
        self._full = full

    def full_key(self, key: str) -> tuple[str, bool]:
        """The full state's key path of this stage's leaf at ``key``, and whether the stage holds a slice of it
        (a stacked leaf)."""
        st, m = self.stage, self.model_opt.model
        if not m.stacked:
            return _LAYER.sub(lambda g: f"['layers'][{int(g.group(1)) + st.layer_start}]", key), False
        full = self._full.get(key)
        sliced = ("['layers']" in key and full is not None and full.shape
                  and full.shape[0] == m.num_layers)
        return key, bool(sliced)

    def cut(self, full_opt: Any) -> Any:
        """This stage's state (host numpy) from the full optimizer state."""
        table = {jax.tree_util.keystr(p): l for p, l in jax.tree_util.tree_flatten_with_path(full_opt)[0]}
        st = self.stage
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.like)
        out = []
        for p, _ in flat:
            key, sliced = self.full_key(jax.tree_util.keystr(p))
            leaf = np.asarray(table[key])
            out.append(leaf[st.layer_start:st.layer_end] if sliced else leaf)
        return jax.tree_util.tree_unflatten(treedef, out)

    def update(self, grads: Any, opt_state: Any, params: Any, globals_: Any = ()) -> tuple[Any, Any]:
        updates, opt_state = self.model_opt.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def partials(self, grads: Any, opt_state: Any, params: Any) -> Any:
        return ()
