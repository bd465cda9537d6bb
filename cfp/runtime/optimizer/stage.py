"""`StageOptimizer`: one stage's inputs, the values it sends per exchange, its update and initial state."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from cfp.errors import ConfigError
from cfp.ir import _jax_internals as jxi
from cfp.runtime.optimizer.flow import Flow
from cfp.runtime.optimizer.param_tree import STACKED, Leaves, Part, StageHolding, Unit
from cfp.runtime.optimizer.update_plan import Analysis, Round, needed, run_eqns


def _shape(flow: Flow, consts: dict, order, reads, atoms) -> tuple:
    """The computation of ``order`` from ``reads`` to ``atoms`` with value ids replaced by positions: two list
    layers' updates with equal shapes run one compiled program (compiled once, the same bits)."""
    local = {v: ("in", i) for i, v in enumerate(reads)}

    def name(a) -> tuple:
        if a[0] == "lit":
            return "lit", repr(a[1]), str(getattr(a[1], "dtype", type(a[1]).__name__))
        if a[1] in local:
            return local[a[1]]
        value = consts[a[1]]      # a scalar constant by value (each layer's update binds its own), else by id
        dtype = getattr(value, "dtype", type(value).__name__)
        return ("const", repr(value), str(dtype)) if getattr(value, "size", 1) == 1 else ("const", a[1])

    eqns = []
    for n, k in enumerate(order):
        eqn, rule = flow.eqns[k], flow.rules.get(k)
        sliced = rule and tuple(ax if flow.of(a).unit is None else None for a, ax in zip(eqn.invars, rule.axes))
        eqns.append((jxi.eqn_text(eqn), tuple(map(name, eqn.invars)), sliced))
        local.update({o: ("v", n, j) for j, o in enumerate(eqn.outvars) if o is not None})
    return tuple(eqns), tuple(map(name, atoms)), tuple(flow.avals[v] for v in reads)


def _unit_order(unit: Unit) -> tuple:
    return [Part.FIRST, Part.LAYERS, Part.LAST].index(unit.part), -1 if unit.layer is None else unit.layer


@dataclasses.dataclass(frozen=True)
class _Group:
    """The update of one unit's leaves (unit None: the replicated state leaves) as its own program."""

    unit: Unit | None
    leaves: tuple             # ("param", whole-tree leaf index) or ("state", state leaf index), per output
    atoms: tuple              # the traced output of each
    order: tuple              # equations it evaluates
    reads: tuple              # value ids it reads: its unit's inputs, replicated state, global values
    own: tuple                # positions in ``reads`` of its unit's parameters and state (donated on request)
    shape: tuple              # its computation up to value ids: equal for list layers that share a program


@dataclasses.dataclass(frozen=True)
class _StagePartial:
    """What a stage sends in one exchange, and the equations computing it."""

    exports: tuple            # (alias id, exported value id) of the values it exports
    reductions: tuple         # reduced value ids it computes on its rows
    shared: tuple             # replicated state input ids it passes on
    order: tuple
    globals_: tuple           # ids of the earlier rounds' global values it reads


def _stage_params_like(leaves: Leaves, params_like: Any, holding: StageHolding) -> tuple[Any, Any, tuple]:
    """(ShapeDtypeStruct tree, treedef, whole-tree leaf index of each of its leaves) of a stage's parameters."""
    start, stop = holding.rows
    layers = params_like["layers"]
    tree = {"first": params_like["first"]} if holding.first else {}
    if stop > start:
        tree["layers"] = (list(layers[start:stop]) if leaves.listed else
                          jax.tree.map(lambda x: jax.ShapeDtypeStruct((stop - start,) + x.shape[1:], x.dtype), layers))
    if holding.last:
        tree["last"] = params_like["last"]
    index = {k: i for i, k in enumerate(leaves.keys)}
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keystr = jax.tree_util.keystr
    full = [keystr(p[:1]) + f"[{p[1].idx + start}]" + keystr(p[2:]) if leaves.listed and p[0].key == "layers"
            else keystr(p) for p, _ in flat]
    return tree, treedef, tuple(index[k] for k in full)


class StageOptimizer:
    """One stage's part of the update (`OptimizerPartition.stage`): its inputs cut from the whole trees, the
    values it sends per exchange (`partials`), its update (`update`) and initial state (`init`)."""

    def __init__(self, an: Analysis, holding: StageHolding, programs: dict):
        self._an, self.holding, self._programs = an, holding, programs
        self.params_like, self._treedef, self.param_leaves = _stage_params_like(an.leaves, an.params_like, holding)
        self._held = tuple(j for j, c in enumerate(an.state_cls) if holding.holds(c.unit))
        self.state_like = {an.state_keys[j]: self._rows_like(an.state_like[j], an.state_cls[j].unit)
                           for j in self._held}
        io = an.io
        self._inputs = {*(io.grads[i] for i in self.param_leaves), *(io.params[i] for i in self.param_leaves),
                        *(io.state[j] for j in self._held), *an.prog.consts}
        self._partials = tuple(self._partial_plan(r, plan) for r, plan in enumerate(an.rounds))
        units = [None] + sorted({an.leaves.units[i] for i in self.param_leaves}
                                | {an.state_cls[j].unit for j in self._held} - {None}, key=_unit_order)
        self._groups = tuple(self._group(u) for u in units)

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The keys of this stage's optimizer-state dict (keystr paths in the whole state)."""
        return tuple(self.state_like)

    def _rows_like(self, like, unit: Unit | None):
        if unit is not None and unit.stacked:
            start, stop = self.holding.rows
            return jax.ShapeDtypeStruct((stop - start,) + tuple(like.shape[1:]), like.dtype)
        return like

    def _group(self, unit: Unit | None) -> "_Group":
        """The update of ``unit``'s leaves (None: the replicated state) from its inputs and global values."""
        an, io = self._an, self._an.io
        leaves = (tuple(("param", i) for i in self.param_leaves if an.leaves.units[i] == unit)
                  + tuple(("state", j) for j in self._held if an.state_cls[j].unit == unit))
        atoms = tuple(io.new_params[i] if kind == "param" else io.new_state[i] for kind, i in leaves)
        have = self._inputs | set(an.glob)
        targets = [a[1] for a in atoms if a[0] == "var"]
        order = needed(an.flow, an.producers, targets, have)
        self._check(an.flow, order)
        reads = {a[1] for k in order for a in an.flow.eqns[k].invars if a[0] == "var"} | set(targets)
        reads = tuple(sorted((reads & have) - set(an.prog.consts)))
        own = {*(io.params[i] for kind, i in leaves if kind == "param"),
               *(io.state[j] for kind, j in leaves if kind == "state" and unit is not None)}
        outs = tuple((like, u is not None and u.stacked, an.flow.of(a).unit is None)
                     for (like, u), a in zip(map(self._like, leaves), atoms))
        return _Group(unit, leaves, atoms, order, reads, tuple(k for k, v in enumerate(reads) if v in own),
                      _shape(an.flow, an.prog.consts, order, reads, atoms) + (outs,))

    def _like(self, leaf: tuple):
        kind, i = leaf
        an = self._an
        if kind == "param":
            return self._rows_like(an.leaves.likes[i], an.leaves.units[i]), an.leaves.units[i]
        return self.state_like[an.state_keys[i]], an.state_cls[i].unit

    def _program(self, group: "_Group", donate: bool) -> Callable:
        """The compiled update of ``group``: one program per unit (and rows of the stacked layers), shared by
        every stage and pipeline holding it -- and by list layers of equal shapes -- so they compute the same
        bits (XLA rewrites an expression by its program's context: contracts a*b+c into an FMA, turns x/y
        into x*(1/y))."""
        rows = self.holding.rows if group.unit is not None and group.unit.stacked else None
        key = (group.shape, rows, donate)
        if key not in self._programs:
            an, likes = self._an, [self._like(leaf) for leaf in group.leaves]

            def program(*args):
                env = {**an.prog.consts, **dict(zip(group.reads, args))}
                run_eqns(an.flow, group.order, env, self.holding.rows)
                return tuple(self._output(env, an.flow, atom, unit, like)
                             for atom, (like, unit) in zip(group.atoms, likes))

            self._programs[key] = jax.jit(program, donate_argnums=group.own if donate else ())
        return self._programs[key]

    def _partial_plan(self, r: int, plan: Round) -> _StagePartial:
        an, holds = self._an, self.holding.holds
        exports = tuple((a, an.flow.exports[a]) for a in plan.exports if holds(an.flow.cls[an.flow.exports[a]].unit))
        reductions = plan.reductions if holds(STACKED) else ()
        earlier = tuple(v for v, n in an.glob.items() if n <= r)
        order = needed(an.flow, an.producers, [v for _, v in exports] + list(reductions), self._inputs | set(earlier))
        self._check(an.flow, order)
        return _StagePartial(exports, reductions, plan.shared, order, earlier)

    def _check(self, flow: Flow, order) -> None:
        """Every equation a stage runs is on its own units or replicated values."""
        for k in order:
            units = {flow.cls[o].unit for o in flow.eqns[k].outvars if o is not None}
            if k in flow.rules and not self.holding.holds(STACKED) or not all(map(self.holding.holds, units)):
                raise RuntimeError(f"optimizer partition: stage {self.holding} would evaluate `{flow.eqns[k].name}` "
                                   f"on values it does not hold (a bug in cfp.runtime.optimizer)")

    def cut_params(self, full: Any) -> Any:
        """This stage's part of a whole parameter (or gradient) tree: its keys, stacked leaves' rows."""
        leaves = self._an.leaves
        flat = leaves.treedef.flatten_up_to(full)
        start, stop = self.holding.rows
        picked = [flat[i][start:stop] if leaves.units[i].stacked else flat[i] for i in self.param_leaves]
        return jax.tree_util.tree_unflatten(self._treedef, picked)

    def cut_state(self, full_state: Any) -> dict:
        """This stage's part of the whole optimizer state: ``{keystr(path): leaf}`` of the leaves it holds
        (stacked ones' rows; replicated ones whole)."""
        an = self._an
        flat = an.state_treedef.flatten_up_to(full_state)
        start, stop = self.holding.rows
        return {an.state_keys[j]: flat[j][start:stop] if an.state_cls[j].unit is not None
                and an.state_cls[j].unit.stacked else flat[j] for j in self._held}

    def _env(self, grads: Any, opt_state: dict, params: Any, globals_: dict, wanted) -> dict:
        an = self._an
        env = dict(an.prog.consts)
        for tree, ids in ((grads, an.io.grads), (params, an.io.params)):
            for i, leaf in zip(self.param_leaves, self._treedef.flatten_up_to(tree)):
                env[ids[i]] = leaf
        missing = [an.state_keys[j] for j in self._held if an.state_keys[j] not in opt_state]
        lost = [v for v in wanted if v not in globals_]
        if missing or lost:
            raise ConfigError(f"stage {self.holding}: optimizer state lacks {missing[:3]}" if missing else
                              f"stage {self.holding}: {len(lost)} global values missing; run every earlier round")
        env.update({an.io.state[j]: opt_state[an.state_keys[j]] for j in self._held})
        env.update({v: globals_[v] for v in wanted})
        return env

    def partials(self, round: int, grads: Any, opt_state: dict, params: Any, globals_: dict) -> dict:
        """What this stage sends in exchange ``round`` (given the earlier rounds' ``globals_``): the scalars it
        exports, its partial reductions over its layer rows and the replicated state `combine` reads."""
        plan = self._partials[round]
        env = self._env(grads, opt_state, params, globals_, plan.globals_)
        run_eqns(self._an.flow, plan.order, env, self.holding.rows)
        return {"export": {a: env[v] for a, v in plan.exports}, "reduce": {v: env[v] for v in plan.reductions},
                "shared": {v: env[v] for v in plan.shared}}

    def update(self, grads: Any, opt_state: dict, params: Any, globals_: dict,
               donate: bool = False) -> tuple[Any, dict]:
        """This stage's new ``(params, opt_state)``: ``tx.update`` and ``apply_updates`` on its part, with the
        global values of every round (``{}`` when `OptimizerPartition.rounds` is 0). Each unit's leaves are
        updated by their own compiled program (`_program`); call it outside ``jax.jit`` to keep them apart.
        ``donate``: each unit's parameter and state buffers are given to its program (for the new ones)."""
        an = self._an
        env = self._env(grads, opt_state, params, globals_, tuple(an.glob))
        new = {}
        for group in self._groups:
            new.update(zip(group.leaves, self._program(group, donate)(*(env[v] for v in group.reads))))
        return (jax.tree_util.tree_unflatten(self._treedef, [new[("param", i)] for i in self.param_leaves]),
                {an.state_keys[j]: new[("state", j)] for j in self._held})

    def _output(self, env: dict, flow: Flow, atom, unit: Unit | None, like) -> Any:
        """An output value at this stage: a literal broadcast, a replicated value of a stacked leaf cut to rows."""
        if atom[0] == "lit":
            return jnp.broadcast_to(jnp.asarray(atom[1], like.dtype), like.shape)
        value = env[atom[1]]
        if unit is not None and unit.stacked and flow.of(atom).unit is None:
            start, stop = self.holding.rows
            value = jax.lax.slice_in_dim(value, start, stop, axis=0)
        return value

    def init(self, params: Any) -> dict:
        """This stage's initial optimizer state from its parameters (``tx.init`` on its part; `ConfigError`
        where an initial value needs other stages' parameters: cut the whole ``tx.init`` instead)."""
        an, init = self._an, self._an.init
        if init.error:
            raise ConfigError(f"the optimizer's init cannot run per stage: {init.error}")
        env = dict(init.prog.consts)
        for i, leaf in zip(self.param_leaves, self._treedef.flatten_up_to(params)):
            env[init.prog.invars[i]] = leaf
        outs = [init.prog.outvars[j] for j in self._held]
        order = needed(init.flow, init.producers, [a[1] for a in outs if a[0] == "var"], set(env))
        self._check(init.flow, order)
        run_eqns(init.flow, order, env, self.holding.rows)
        return {an.state_keys[j]: self._output(env, init.flow, a, an.state_cls[j].unit,
                                               self.state_like[an.state_keys[j]]) for j, a in zip(self._held, outs)}
