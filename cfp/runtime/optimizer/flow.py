"""The class of every value of a traced optimizer update: which unit's stage computes it, or that every stage
can (replicated and global values), and how many exchanges it waits for."""
from __future__ import annotations

import dataclasses
import math

from cfp.ir import _jax_internals as jxi
from cfp.runtime.optimizer.param_tree import STACKED, Leaves, Unit

# The most values one global reduction over the layers may hold (they cross stages every step).
GLOBAL_LIMIT = 4096


@dataclasses.dataclass(frozen=True)
class ValueClass:
    """A value's class: the unit whose stage computes it (None: any stage can, the same everywhere), how many
    global exchanges it waits for, and the parameter leaves (indices) a unit's value derives from."""

    unit: Unit | None = None
    round: int = 0
    leaves: frozenset = frozenset()


REPL = ValueClass()


@dataclasses.dataclass
class Flow:
    """The classes the walk over the traced update gives."""

    avals: dict                                        # value id -> (shape, dtype), aliases included
    cls: dict                                          # value id -> ValueClass
    layers: int                                        # L
    # the program's equations with exported operands read as their aliases, and the copies that compute an
    # alias from other aliases (`Walker._alias`)
    eqns: list = dataclasses.field(default_factory=list)
    rules: dict = dataclasses.field(default_factory=dict)      # equation index -> LayerRule (stacked values)
    exports: dict = dataclasses.field(default_factory=dict)    # alias id -> the unit value its stage sends
    alias_of: dict = dataclasses.field(default_factory=dict)   # unit value id -> alias id (global)
    # a unit scalar's earliest round as a global value, and (`via`) the equation that recomputes it from global
    # values where that is earlier than sending it
    export_round: dict = dataclasses.field(default_factory=dict)
    via: dict = dataclasses.field(default_factory=dict)
    reductions: dict = dataclasses.field(default_factory=dict)  # reduced value id -> combine name
    errors: list = dataclasses.field(default_factory=list)

    def of(self, atom) -> ValueClass:
        return self.cls[atom[1]] if atom[0] == "var" else REPL

    def size(self, vid: int) -> int:
        return math.prod(self.avals[vid][0])


class Walker:
    """Classifies every value of the traced update (`ValueClass`), equation by equation."""

    def __init__(self, prog: jxi.OptProgram, leaves: Leaves):
        self.prog, self.leaves = prog, leaves

    def walk(self, inputs: dict[int, ValueClass]) -> Flow:
        flow = Flow(dict(self.prog.avals), {**{c: REPL for c in self.prog.consts}, **inputs}, self.leaves.layers)
        self.next_id = max(self.prog.avals, default=0) + 1
        for eqn in self.prog.eqns:
            atoms = list(eqn.invars)
            self._export_scalars(flow, eqn, atoms)
            eqn = dataclasses.replace(eqn, invars=tuple(atoms))
            flow.eqns.append(eqn)
            out = self._classify(flow, len(flow.eqns) - 1, eqn, atoms)
            for o in eqn.outvars:
                if o is not None:
                    flow.cls[o] = out
            if out.unit is not None and not out.unit.stacked:
                self._note_export_round(flow, len(flow.eqns) - 1, eqn, out)
        return flow

    def _note_export_round(self, flow: Flow, k: int, eqn, out: ValueClass) -> None:
        """A unit scalar computed by scalar operations from global values and other unit scalars can be
        recomputed from those (as global values) instead of being sent once computed, a round later: a running
        sum of per-leaf norms must not take one round per unit."""
        outs = [o for o in eqn.outvars if o is not None]
        ins = [(a, flow.of(a)) for a in eqn.invars]
        if len(outs) == 1 and flow.size(outs[0]) == 1 and all(flow.size(a[1]) == 1 for a, c in ins if c.unit):
            via = max((flow.export_round.get(a[1], c.round + 1) if c.unit else c.round for a, c in ins), default=0)
            if via < out.round + 1:
                flow.export_round[outs[0]], flow.via[outs[0]] = via, k

    def _export_scalars(self, flow: Flow, eqn, atoms: list) -> None:
        """Where an equation mixes units, the scalars of all units but (at most) one non-scalar unit become
        global values (exported by their stage); two non-scalar units cannot mix."""
        local = [i for i, a in enumerate(atoms) if flow.of(a).unit is not None]
        if len({flow.of(atoms[i]).unit for i in local}) < 2:
            return
        big = [i for i in local if flow.size(atoms[i][1]) != 1 or flow.of(atoms[i]).unit.stacked]
        big_units = {flow.of(atoms[i]).unit for i in big}
        if len(big_units) > 1:
            a, b = sorted(big_units, key=repr)[:2]
            la = frozenset().union(*(flow.of(atoms[i]).leaves for i in big if flow.of(atoms[i]).unit == a))
            lb = frozenset().union(*(flow.of(atoms[i]).leaves for i in big if flow.of(atoms[i]).unit == b))
            flow.errors.append(f"`{eqn.name}` combines whole values derived from {self.leaves.describe(la)} and "
                               f"from {self.leaves.describe(lb)}, which different stages hold (only scalars "
                               f"may cross stages)")
            return
        for i in local:
            if flow.of(atoms[i]).unit not in big_units:
                atoms[i] = ("var", self._alias(flow, atoms[i][1]))

    def _alias(self, flow: Flow, vid: int) -> int:
        """The global value standing for unit scalar ``vid``: sent by its stage, or recomputed (`via`)."""
        if vid in flow.alias_of:
            return flow.alias_of[vid]
        alias = self.next_id
        self.next_id += 1
        flow.avals[alias] = flow.avals[vid]
        if vid in flow.via:
            src = flow.eqns[flow.via[vid]]
            atoms = tuple(("var", self._alias(flow, a[1])) if flow.of(a).unit is not None else a for a in src.invars)
            flow.eqns.append(dataclasses.replace(src, invars=atoms, outvars=(alias,)))
            flow.cls[alias] = ValueClass(None, flow.export_round[vid])
        else:
            flow.cls[alias] = ValueClass(None, flow.cls[vid].round + 1)
            flow.exports[alias] = vid
        flow.alias_of[vid] = alias
        return alias

    def _classify(self, flow: Flow, k: int, eqn, atoms: list) -> ValueClass:
        ins = [flow.of(a) for a in atoms]
        rnd = max((c.round for c in ins), default=0)
        units = {c.unit for c in ins if c.unit is not None}
        if not units:
            return ValueClass(None, rnd)
        leaves = frozenset().union(*(c.leaves for c in ins))
        unit = sorted(units, key=repr)[0]
        if len(units) > 1 or not unit.stacked:
            return ValueClass(unit, rnd, leaves)
        rule = jxi.layer_rule(eqn, [c.unit == STACKED for c in ins], flow.avals, self.leaves.layers)
        reason = rule.reason if rule.kind is jxi.LayerKind.REFUSE else self._check_rows(flow, eqn, atoms, rule)
        if reason:
            flow.errors.append(f"{reason} (on the layer-stacked {self.leaves.describe(leaves)}); a stage holds "
                               f"only its own layers' rows")
            return ValueClass(unit, rnd, leaves)
        flow.rules[k] = rule
        if rule.kind is jxi.LayerKind.ROWS:
            return ValueClass(unit, rnd, leaves)
        (out,) = eqn.outvars
        if flow.size(out) > GLOBAL_LIMIT:
            flow.errors.append(f"`{eqn.name}` over the layers of {self.leaves.describe(leaves)} gives "
                               f"{flow.size(out)} values to exchange between stages (at most {GLOBAL_LIMIT})")
        flow.reductions[out] = rule.combine
        return ValueClass(None, rnd + 1)

    def _check_rows(self, flow: Flow, eqn, atoms: list, rule: jxi.LayerRule) -> str:
        """'' when every operand's layer-aligned axis and every ROWS output's dim 0 has a positive multiple of
        L rows; else the reason."""
        def aligned(shape, axis) -> bool:
            return axis < len(shape) and shape[axis] > 0 and shape[axis] % self.leaves.layers == 0

        for a, axis in zip(atoms, rule.axes):
            if axis is not None and (a[0] != "var" or not aligned(flow.avals[a[1]][0], axis)):
                return f"`{eqn.name}` pairs the layer dim with a dim of another size"
        if rule.kind is jxi.LayerKind.ROWS:
            if any(o is not None and not aligned(flow.avals[o][0], 0) for o in eqn.outvars):
                return f"`{eqn.name}` leaves the layer dim"
        return ""
