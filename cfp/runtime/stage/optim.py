"""A stage's share of the user's optimizer, on the runtime's terms: the partition of any optax transformation
(`cfp.runtime.optimizer`) bound to a model and to the stages of a layout.

`ModelOptimizer` partitions the transformation once per model (refusing, before any training, one that cannot be
computed stage by stage) and gives each placed stage its `StageOptimizer`: the stage's optimizer state (a
``{keystr(path): leaf}`` dict of the leaves it holds, cut from the whole state), its exchange of global values
(e.g. the squared norms behind a global-norm clip) and its update, one compiled program per unit so that every
pipeline computes the same bits.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import optax

from cfp.layered.model import LayeredModel
from cfp.layout import PlacedStage
from cfp.runtime.optimizer import OptimizerPartition, StageHolding

_LAYER = re.compile(r"^\['layers'\]\[(\d+)\]")


def holding_of(st: PlacedStage) -> StageHolding:
    return StageHolding(st.is_first, st.layer_start, st.layer_end, st.is_last)


class ModelOptimizer:
    """The optimizer of a whole `LayeredModel`, split by stage."""

    def __init__(self, tx: optax.GradientTransformation, model: LayeredModel):
        self.tx, self.model = tx, model
        self.params_like = model.abstract().params
        self.partition = OptimizerPartition.of(tx, self.params_like)
        self.like = self.partition.state_like
        self.rounds = self.partition.rounds
        self.has_globals = self.rounds > 0
        self.globals_like = self.partition.globals_like()
        self._combine = jax.jit(self.partition.combine, static_argnums=0)
        self._stages: dict[StageHolding, StageOptimizer] = {}

    def stage(self, st: PlacedStage) -> "StageOptimizer":
        h = holding_of(st)
        if h not in self._stages:
            self._stages[h] = StageOptimizer(self, h)
        return self._stages[h]

    def combine(self, round_: int, partials: Sequence[Any], globals_: dict) -> dict:
        """The global values of exchange ``round_`` from one pipeline's partials, in stage order."""
        return self._combine(round_, list(partials), globals_)

    def merge(self, params: Sequence[Any], states: Sequence[dict], stages: Sequence[PlacedStage]) -> tuple:
        """The whole ``(params, opt_state)`` (host numpy) from one pipeline's stages, in stage order."""
        return self.partition.merge([(holding_of(st), p, s) for st, p, s in zip(stages, params, states)])


class StageOptimizer:
    """One stage's part: its parameters' and state's structure, how to cut them, its exchange and update."""

    def __init__(self, model_opt: ModelOptimizer, holding: StageHolding):
        self.model_opt, self.holding = model_opt, holding
        self.part = model_opt.partition.stage(holding)
        self.params_like = self.part.params_like
        self.like = self.part.state_like
        self.globals_like = model_opt.globals_like
        self._partials = jax.jit(self.part.partials, static_argnums=0)

    def cut(self, full_opt: Any) -> dict:
        """This stage's optimizer state (host arrays) from the whole state."""
        return self.part.cut_state(full_opt)

    def partials(self, round_: int, grads: Any, opt_state: dict, params: Any, globals_: dict) -> dict:
        return self._partials(round_, grads, opt_state, params, globals_)

    def partials_like(self, round_: int) -> Any:
        return jax.eval_shape(self.part.partials, round_, self.params_like, self.like, self.params_like,
                              self.globals_like)

    def update(self, grads: Any, opt_state: dict, params: Any, globals_: dict) -> tuple[Any, dict]:
        """New ``(params, opt_state)``: the stage's units, each its own compiled program (donating its buffers)."""
        return self.part.update(grads, opt_state, params, globals_, donate=True)

    def state_shardings(self, param_shardings: Any, replicated: Any) -> dict:
        """Per state key: the sharding of the parameter it mirrors (same shape), else ``replicated``."""
        table = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}
        start = self.holding.start
        mirrors = self.model_opt.partition.param_of_state()
        out = {}
        for key in self.like:
            full = mirrors.get(key)
            local = None if full is None else _LAYER.sub(lambda m: f"['layers'][{int(m.group(1)) - start}]", full) \
                if not self.model_opt.model.stacked else full
            out[key] = table.get(local, replicated) if local is not None else replicated
        return out
