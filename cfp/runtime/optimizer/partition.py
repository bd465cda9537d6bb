"""`OptimizerPartition`: the entry point (see the package docstring)."""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cfp.errors import ConfigError
from cfp.runtime.optimizer.param_tree import StageHolding, Unit
from cfp.runtime.optimizer.stage import StageOptimizer
from cfp.runtime.optimizer.update_plan import COMBINE, Analysis, analyse, run_eqns


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


class OptimizerPartition:
    """An optax transformation's update on a layered model, split into stages (see the package docstring)."""

    def __init__(self, analysis: Analysis):
        self._an = analysis
        self._stages: dict[StageHolding, StageOptimizer] = {}
        self._programs: dict = {}      # (unit update's shape, stacked rows, donate) -> its compiled program

    @classmethod
    def of(cls, tx: optax.GradientTransformation, params_like: Any, grads_like: Any = None) -> "OptimizerPartition":
        """Trace ``tx`` on ``params_like`` (``{"first", "layers", "last"}`` of arrays or ShapeDtypeStructs;
        gradients like ``grads_like``, default the same) and prove it runs per stage; `ConfigError` if not."""
        params_like = _abstract(params_like)
        grads_like = params_like if grads_like is None else _abstract(grads_like)
        return cls(analyse(tx, params_like, grads_like))

    @property
    def layers(self) -> int:
        """The model's layer count L."""
        return self._an.leaves.layers

    @property
    def rounds(self) -> int:
        """Exchanges of global values per step (0: each stage updates alone)."""
        return len(self._an.rounds)

    @property
    def state_like(self) -> Any:
        """The whole optimizer state, as ShapeDtypeStructs in the user's structure."""
        return jax.tree_util.tree_unflatten(self._an.state_treedef, self._an.state_like)

    def globals_like(self) -> dict:
        """``{id: ShapeDtypeStruct}`` of every global value `combine` gives (empty when ``rounds`` is 0)."""
        avals = self._an.flow.avals
        return {v: jax.ShapeDtypeStruct(avals[v][0], avals[v][1]) for v in sorted(self._an.glob)}

    def param_of_state(self) -> dict[str, str]:
        """``{state key: parameter key}`` (keystr paths) for each state leaf derived from exactly one
        parameter leaf and of its shape: it can take that parameter's sharding."""
        an, out = self._an, {}
        for key, like, c in zip(an.state_keys, an.state_like, an.state_cls):
            if c.unit is not None and len(c.leaves) == 1:
                (i,) = c.leaves
                if tuple(like.shape) == tuple(an.leaves.likes[i].shape):
                    out[key] = an.leaves.keys[i]
        return out

    def stage(self, holding: StageHolding) -> "StageOptimizer":
        """The part of the update that a stage holding ``holding`` runs (built once per holding)."""
        if holding.stop > self.layers:
            raise ConfigError(f"stage layers [{holding.start}, {holding.stop}) exceed the model's {self.layers}")
        if holding not in self._stages:
            self._stages[holding] = StageOptimizer(self._an, holding, self._programs)
        return self._stages[holding]

    def combine(self, round: int, partials: Sequence[dict], globals_: dict) -> dict:
        """Global values of exchange ``round`` from one pipeline's stage partials (in stage order) and the
        earlier rounds' ``globals_``; returns ``globals_`` with this round's values added."""
        an = self._an
        plan = an.rounds[round]
        env = {**an.prog.consts, **globals_, **{v: partials[0]["shared"][v] for v in plan.shared}}
        for alias in plan.exports:
            held = [p["export"][alias] for p in partials if alias in p["export"]]
            if len(held) != 1:
                raise ConfigError(f"{len(held)} stages of the pipeline export the value of "
                                  f"{an.leaves.describe(an.flow.cls[an.flow.exports[alias]].leaves)}; exactly "
                                  f"one must (check the stages' holdings with check_pipeline)")
            env[alias] = held[0]
        for v in plan.reductions:
            parts = [p["reduce"][v] for p in partials if v in p["reduce"]]
            if not parts:
                raise ConfigError("no stage of the pipeline holds a layer")
            env[v] = functools.reduce(COMBINE[an.flow.reductions[v]], parts)
        run_eqns(an.flow, plan.order, env, None)
        return {**globals_, **{v: env[v] for v in plan.values}}

    def exchange(self, pipeline: Sequence[tuple["StageOptimizer", Any, dict, Any]]) -> dict:
        """Every round's global values from one pipeline's ``(stage, grads, opt_state, params)`` in stage
        order (the loop of the module docstring, on whatever devices the values are)."""
        glob: dict = {}
        for r in range(self.rounds):
            glob = self.combine(r, [st.partials(r, g, s, p, glob) for st, g, s, p in pipeline], glob)
        return glob

    def check_pipeline(self, holdings: Sequence[StageHolding]) -> None:
        """`ConfigError` unless ``holdings`` (in stage order) hold "first" once, "last" once and layers
        [0, L) in order."""
        firsts = sum(h.first for h in holdings)
        lasts = sum(h.last for h in holdings)
        ranges = [h.rows for h in holdings]
        edges = [0] + [b for _, b in ranges]
        if firsts != 1 or lasts != 1 or any(a != e for (a, _), e in zip(ranges, edges)) or edges[-1] != self.layers:
            raise ConfigError(f"a pipeline's stages must hold first once ({firsts}), last once ({lasts}) and "
                              f"layers [0, {self.layers}) in order; got {ranges}")

    def merge(self, stages: Sequence[tuple[StageHolding, Any, dict]]) -> tuple[Any, Any]:
        """The user's whole ``(params, opt_state)`` (host numpy) from one pipeline's ``(holding, stage params,
        stage opt_state)`` in stage order; a replicated state leaf comes from the first stage."""
        self.check_pipeline([h for h, _, _ in stages])
        parts = [(self.stage(h), p, s) for h, p, s in stages]
        an = self._an
        params = [_gather(i, u, [(st, dict(zip(st.param_leaves, jax.tree_util.tree_leaves(p)))) for st, p, _ in parts])
                  for i, u in enumerate(an.leaves.units)]
        state = [_gather(key, c.unit, [(st, s) for st, _, s in parts])
                 for key, c in zip(an.state_keys, an.state_cls)]
        return (jax.tree_util.tree_unflatten(an.leaves.treedef, params),
                jax.tree_util.tree_unflatten(an.state_treedef, state))


def _gather(key, unit: Unit | None, tables: list) -> np.ndarray:
    """One whole leaf from the stages' ``(stage, {key: value})``: the rows of every stage holding layers for a
    stacked unit, else the first stage holding it."""
    if unit is not None and unit.stacked:
        return np.concatenate([np.asarray(t[key]) for st, t in tables if st.holding.holds(unit)])
    value = next(t[key] for st, t in tables if st.holding.holds(unit))
    # a PRNG key (noisy_sgd's state) has no numpy form: kept as it is
    return value if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended) else np.asarray(value)
