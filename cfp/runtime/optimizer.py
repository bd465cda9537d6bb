"""Any optax transformation run stage by stage, computing what it computes on one device.

A layered model's parameters are ``{"first": tree, "layers": L, "last": tree}``, where ``layers`` is a list of
L per-layer trees (the **list form**) or one tree whose every leaf has a leading layer dim of size L (the
**stacked form**: ``nn.scan``, ``nnx.vmap``, ``eqx.filter_vmap``). A stage holds (`StageHolding`) "first" or
not, layers ``[start, stop)`` and "last" or not. ``OptimizerPartition.of(tx, params_like)`` traces
``tx.update`` followed by ``optax.apply_updates`` once on the whole abstract tree (nothing is allocated), in the
user's own structure, and proves that each stage can compute its own part of exactly that:

* every parameter leaf has a **unit**, the place that holds it: "first", "last", list layer i, or the stacked
  layers (a stage holds rows ``[start, stop)`` of every stacked leaf). An optimizer-state leaf takes the unit
  of the value that replaces it (a fixpoint over the update); one that depends on no parameter (``count``, a
  schedule's step, a PRNG key) is **replicated**: every stage keeps its own copy, and the copies stay equal;
* an operation on one unit's values (and replicated ones) runs on that unit's stage. On stacked values it must
  keep the layers apart (elementwise ops, reductions over other dims, dims moved around the layer dim,
  dot_general batched over it, reshapes that keep each layer's elements whole rows, ...: the rules are
  `cfp.ir._jax_internals.layer_rule`); it then runs on the stage's rows with its shape params rewritten, and
  replicated operands of layer size are sliced to those rows. ``lax.cond`` is seen through (both branches,
  then a select), so ``optax.apply_if_finite`` and ``optax.MultiSteps`` split too;
* a **global** value depends on several units: a scalar that one unit's stage computes and **exports** (a
  leaf's squared norm), or a reduction over the layers of a stacked leaf, computed per stage on its rows and
  **combined** (sum, max, min, product, and, or) in stage order, at most `GLOBAL_LIMIT` values. What is then
  computed from global values only (the global norm and clip factor, adafactor's RMS of a stacked leaf) is
  evaluated once by `OptimizerPartition.combine`.

Refused before any training, with a one-line `ConfigError` naming the leaves and the primitive: an operation
combining the whole (non-scalar) values of two units (``optax.flatten``'s concatenation, a transform adding
one leaf's gradient to another's), an operation on a stacked leaf that mixes its layers other than by a
reduction (``x[::-1]``, a reshape cutting through a layer, opaque control flow), a reduction over the layers
yielding more than `GLOBAL_LIMIT` values, and a new parameter value depending on another unit. Not supported:
``tx.update`` needing extra arguments (``value=`` of polyak_sgd, lbfgs' line search).

**Per step** (inputs per stage: its gradients -- summed over every pipeline -- and parameters as
``st.cut_params`` cuts them from whole trees: the keys "first", "layers", "last" it holds, stacked leaves as
rows ``[start, stop)``; its optimizer state as ``st.cut_state`` cuts it: ``{keystr(path): leaf}``)::

    p = OptimizerPartition.of(tx, params_like)
    stages = [p.stage(h) for h in holdings]              # per pipeline, in stage order
    glob = {}
    for r in range(p.rounds):                            # 0 when nothing crosses stages (adam, lion, sgd...)
        parts = [st.partials(r, g, s, w, glob) for st, g, s, w in pipeline_0]   # in stage order
        glob = p.combine(r, parts, glob)                 # small: scalars and layer reductions
    for every stage of every pipeline: w, s = st.update(g, s, w, glob)

``partials`` and ``combine`` are pure and jit-able. ``rounds`` is 1 for a global norm over any number of
units; a global value needing another one first takes a round more (adafactor's parameter scale on a stacked
leaf, a second global norm after a clip). ``update`` runs each unit's part as its own compiled program
(cached per unit shape; list layers of equal shapes share one), so call it outside ``jax.jit``.

**Bit-identity across pipelines.** The global values come from pipeline 0's partials only, and every stage of
every pipeline gets the same ones. Everything else a stage computes is one unit's values, and a unit's update
is the same compiled program in every pipeline holding it: XLA compiles an expression according to the program
around it (it contracts ``a*b+c`` into an FMA and turns ``x/y`` into ``x*(1/y)`` by context: two stages with
other boundaries, compiled as one program each, differed in the last bit), so one program per unit keeps the
bits equal. The stacked layers' program differs by its row count only. Stage programs compiled for other
shardings (another TP degree) may still differ where a unit's update reduces over a sharded dim. NaN and Inf
propagate as on one device (nothing is masked). `OptimizerPartition.merge` rebuilds the user's whole
``(params, opt_state)`` (host numpy) from one pipeline's stages, for checkpoints and verification.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cfp.errors import ConfigError
from cfp.ir import _jax_internals as jxi

# The most values one global reduction over the layers may hold (they cross stages every step).
GLOBAL_LIMIT = 4096

_COMBINE: dict[str, Callable] = {"add": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "mul": jnp.multiply,
                                 "and": jnp.logical_and, "or": jnp.logical_or}


class Part(enum.Enum):
    """The three parts of a layered model's parameter tree."""

    FIRST = "first"
    LAYERS = "layers"
    LAST = "last"


@dataclasses.dataclass(frozen=True)
class Unit:
    """Where a parameter leaf lives: "first", "last", list layer ``layer``, or (``layer`` None) the stacked
    layers."""

    part: Part
    layer: int | None = None

    @property
    def stacked(self) -> bool:
        return self.part is Part.LAYERS and self.layer is None


_STACKED = Unit(Part.LAYERS)


@dataclasses.dataclass(frozen=True)
class StageHolding:
    """What one stage holds: "first" or not, layers ``[start, stop)``, "last" or not."""

    first: bool
    start: int
    stop: int
    last: bool

    def __post_init__(self):
        if not 0 <= self.start <= self.stop:
            raise ConfigError(f"stage layers [{self.start}, {self.stop}) must satisfy 0 <= start <= stop")

    @property
    def rows(self) -> tuple[int, int]:
        return self.start, self.stop

    def holds(self, unit: Unit | None) -> bool:
        """Whether the stage holds ``unit``'s values (None: replicated, every stage does)."""
        if unit is None:
            return True
        if unit.part is Part.FIRST:
            return self.first
        if unit.part is Part.LAST:
            return self.last
        if unit.layer is None:
            return self.stop > self.start
        return self.start <= unit.layer < self.stop


@dataclasses.dataclass(frozen=True)
class _Cls:
    """A value's class: the unit whose stage computes it (None: any stage can, the same everywhere), how many
    global exchanges it waits for, and the parameter leaves (indices) a unit's value derives from."""

    unit: Unit | None = None
    round: int = 0
    leaves: frozenset = frozenset()


_REPL = _Cls()


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """The flattened parameter tree: each leaf's name and unit."""

    keys: tuple[str, ...]        # keystr of each leaf's path in the whole tree
    units: tuple[Unit, ...]
    likes: tuple                 # ShapeDtypeStruct of each leaf
    treedef: Any
    layers: int                  # L
    listed: bool                 # the list form (else stacked)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple("params" + k for k in self.keys)

    def describe(self, leaves) -> str:
        names = [self.names[i] for i in sorted(leaves)]
        more = f" (and {len(names) - 2} more)" if len(names) > 2 else ""
        return (", ".join(names[:2]) + more) if names else "no parameter"


def _leaf_table(params_like: Any) -> _Leaves:
    """Validate the layered parameter tree and give every leaf its unit."""
    if not isinstance(params_like, dict) or set(params_like) != {p.value for p in Part}:
        got = sorted(params_like) if isinstance(params_like, dict) else type(params_like).__name__
        raise ConfigError(f"layered parameters must be a dict with keys first, layers, last; got {got}")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params_like)
    layers = params_like["layers"]
    listed = isinstance(layers, (list, tuple))
    sizes = {tuple(np.shape(x))[:1] for x in jax.tree_util.tree_leaves(layers)}
    if not listed and (len(sizes) != 1 or min(sizes) in ((), (0,))):
        raise ConfigError(f"stacked layers must all have one leading layer dim of size >= 1; leading sizes of "
                          f"their leaves: {sorted(sizes)}")
    count = len(layers) if listed else sizes.pop()[0]
    units = tuple(Unit(Part(path[0].key), path[1].idx if path[0].key == "layers" and listed else None)
                  for path, _ in flat)
    return _Leaves(tuple(jax.tree_util.keystr(path) for path, _ in flat), units, tuple(x for _, x in flat),
                   treedef, count, listed)


@dataclasses.dataclass
class _Flow:
    """The classes the walk over the traced update gives."""

    avals: dict                                        # value id -> (shape, dtype), aliases included
    cls: dict                                          # value id -> _Cls
    layers: int                                        # L
    # the program's equations with exported operands read as their aliases, and the copies that compute an
    # alias from other aliases (`_Walker._alias`)
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

    def of(self, atom) -> _Cls:
        return self.cls[atom[1]] if atom[0] == "var" else _REPL

    def size(self, vid: int) -> int:
        return math.prod(self.avals[vid][0])


class _Walker:
    """Classifies every value of the traced update (`_Cls`), equation by equation."""

    def __init__(self, prog: jxi.OptProgram, leaves: _Leaves):
        self.prog, self.leaves = prog, leaves

    def walk(self, inputs: dict[int, _Cls]) -> _Flow:
        flow = _Flow(dict(self.prog.avals), {**{c: _REPL for c in self.prog.consts}, **inputs}, self.leaves.layers)
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

    def _note_export_round(self, flow: _Flow, k: int, eqn, out: _Cls) -> None:
        """A unit scalar computed by scalar operations from global values and other unit scalars can be
        recomputed from those (as global values) instead of being sent once computed, a round later: a running
        sum of per-leaf norms must not take one round per unit."""
        outs = [o for o in eqn.outvars if o is not None]
        ins = [(a, flow.of(a)) for a in eqn.invars]
        if len(outs) == 1 and flow.size(outs[0]) == 1 and all(flow.size(a[1]) == 1 for a, c in ins if c.unit):
            via = max((flow.export_round.get(a[1], c.round + 1) if c.unit else c.round for a, c in ins), default=0)
            if via < out.round + 1:
                flow.export_round[outs[0]], flow.via[outs[0]] = via, k

    def _export_scalars(self, flow: _Flow, eqn, atoms: list) -> None:
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

    def _alias(self, flow: _Flow, vid: int) -> int:
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
            flow.cls[alias] = _Cls(None, flow.export_round[vid])
        else:
            flow.cls[alias] = _Cls(None, flow.cls[vid].round + 1)
            flow.exports[alias] = vid
        flow.alias_of[vid] = alias
        return alias

    def _classify(self, flow: _Flow, k: int, eqn, atoms: list) -> _Cls:
        ins = [flow.of(a) for a in atoms]
        rnd = max((c.round for c in ins), default=0)
        units = {c.unit for c in ins if c.unit is not None}
        if not units:
            return _Cls(None, rnd)
        leaves = frozenset().union(*(c.leaves for c in ins))
        unit = sorted(units, key=repr)[0]
        if len(units) > 1 or not unit.stacked:
            return _Cls(unit, rnd, leaves)
        rule = jxi.layer_rule(eqn, [c.unit == _STACKED for c in ins], flow.avals, self.leaves.layers)
        reason = rule.reason if rule.kind is jxi.LayerKind.REFUSE else self._check_rows(flow, eqn, atoms, rule)
        if reason:
            flow.errors.append(f"{reason} (on the layer-stacked {self.leaves.describe(leaves)}); a stage holds "
                               f"only its own layers' rows")
            return _Cls(unit, rnd, leaves)
        flow.rules[k] = rule
        if rule.kind is jxi.LayerKind.ROWS:
            return _Cls(unit, rnd, leaves)
        (out,) = eqn.outvars
        if flow.size(out) > GLOBAL_LIMIT:
            flow.errors.append(f"`{eqn.name}` over the layers of {self.leaves.describe(leaves)} gives "
                               f"{flow.size(out)} values to exchange between stages (at most {GLOBAL_LIMIT})")
        flow.reductions[out] = rule.combine
        return _Cls(None, rnd + 1)

    def _check_rows(self, flow: _Flow, eqn, atoms: list, rule: jxi.LayerRule) -> str:
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


@dataclasses.dataclass(frozen=True)
class _Io:
    """Value ids of the traced update's inputs (gradients, state, parameters) and its outputs."""

    grads: tuple
    state: tuple
    params: tuple
    new_params: tuple     # atoms
    new_state: tuple      # atoms


def _live(prog: jxi.OptProgram) -> jxi.OptProgram:
    """The program without equations whose results nothing uses (tracing keeps them; they must not be
    refused for mixing values nobody reads)."""
    used = {a[1] for a in prog.outvars if a[0] == "var"}
    keep = []
    for eqn in reversed(prog.eqns):
        if any(o is not None and o in used for o in eqn.outvars):
            keep.append(eqn)
            used.update(a[1] for a in eqn.invars if a[0] == "var")
    return dataclasses.replace(prog, eqns=tuple(reversed(keep)))


def _fixpoint(prog: jxi.OptProgram, leaves: _Leaves, io: _Io) -> tuple[_Flow, tuple]:
    """Classify the update with each state leaf taking the class of its new value, until nothing changes."""
    walker = _Walker(prog, leaves)
    params = {v: _Cls(leaves.units[i], 0, frozenset({i})) for ids in (io.grads, io.params) for i, v in enumerate(ids)}
    state = (_REPL,) * len(io.state)
    for _ in range(len(io.state) + 2):
        flow = walker.walk({**params, **dict(zip(io.state, state))})
        if flow.errors:     # more local state only adds errors: report the first cause
            return flow, state
        new = tuple(_Cls(c.unit, 0, c.leaves) if c.unit is not None else _REPL
                    for c in map(flow.of, io.new_state))
        if new == state:
            return flow, state
        state = new
    raise ConfigError("optimizer state classes did not settle: its state leaves keep changing unit")


def _output_errors(flow: _Flow, leaves: _Leaves, io: _Io) -> list[str]:
    """A new parameter value must come from its own unit's values (and global or replicated ones)."""
    errors = []
    for name, unit, atom in zip(leaves.names, leaves.units, io.new_params):
        c = flow.of(atom)
        if c.unit is not None and c.unit != unit:
            errors.append(f"the new value of {name} depends on {leaves.describe(c.leaves)}, which another stage "
                          f"may hold")
    return errors


def _producers(flow: _Flow) -> dict[int, int]:
    return {o: k for k, eqn in enumerate(flow.eqns) for o in eqn.outvars if o is not None}


def _needed(flow: _Flow, producers: dict, targets, have) -> tuple[int, ...]:
    """Indices (in program order) of the equations computing ``targets`` from the values in ``have``."""
    eqns: set[int] = set()
    stack = [t for t in targets if t not in have]
    while stack:
        vid = stack.pop()
        k = producers.get(vid)
        if k is None:
            raise RuntimeError(f"optimizer partition: value {vid} is neither computed nor given (a bug in "
                               f"cfp.runtime.optimizer)")
        if k not in eqns:
            eqns.add(k)
            stack.extend(a[1] for a in flow.eqns[k].invars if a[0] == "var" and a[1] not in have)
    return tuple(sorted(eqns))


def _run(flow: _Flow, order, env: dict, rows: tuple[int, int] | None) -> dict:
    """Evaluate the equations ``order`` into ``env``; equations on stacked values run on the rows of layers
    ``rows`` (their replicated operands sliced to those layers' rows)."""
    for k in order:
        eqn = flow.eqns[k]
        vals = [env[a[1]] if a[0] == "var" else a[1] for a in eqn.invars]
        rule = flow.rules.get(k)
        if rule is None:
            outs = jxi.bind_whole(eqn, vals)
        else:
            vals = [_layer_rows(v, axis, rows, flow.layers) if axis is not None and flow.of(a).unit is None else v
                    for v, a, axis in zip(vals, eqn.invars, rule.axes + (None,) * len(vals))]
            outs = jxi.bind_rows(eqn, vals, rows[1] - rows[0], flow.layers)
        for o, v in zip(eqn.outvars, outs):
            if o is not None:
                env[o] = v
    return env


def _layer_rows(value, axis: int, rows: tuple[int, int], layers: int):
    """The rows of layers ``rows`` of a layer-aligned ``axis`` (L * K rows, K per layer)."""
    per = value.shape[axis] // layers
    return jax.lax.slice_in_dim(value, rows[0] * per, rows[1] * per, axis=axis)


def _global_values(prog: jxi.OptProgram, flow: _Flow) -> dict[int, int]:
    """Value id -> round of every value `combine` hands to the stages: each exported scalar and layer
    reduction, and each small value computed from global values that a stage reads (or that is an output)."""
    def is_global(a) -> bool:
        return (a[0] == "var" and flow.of(a).unit is None and flow.of(a).round >= 1
                and flow.size(a[1]) <= GLOBAL_LIMIT)

    def in_combine(k: int, eqn) -> bool:
        return k not in flow.rules and all(o is None or is_global(("var", o)) for o in eqn.outvars)

    out = {v: flow.cls[v].round for v in (*flow.exports, *flow.reductions)}
    reads = [a for k, eqn in enumerate(flow.eqns) if not in_combine(k, eqn) for a in eqn.invars]
    for a in (*reads, *prog.outvars):
        if is_global(a):
            out[a[1]] = flow.cls[a[1]].round
    return out


@dataclasses.dataclass(frozen=True)
class _Round:
    """One exchange of global values: what the stages send (`partials`) and what `combine` computes."""

    exports: tuple            # alias ids exported this round
    reductions: tuple         # reduced value ids combined this round
    shared: tuple             # replicated state input ids `combine` reads (from the first stage's partials)
    values: tuple             # global value ids this round gives
    order: tuple              # equations `combine` evaluates


def _rounds(prog: jxi.OptProgram, flow: _Flow, producers: dict, glob: dict, shared: frozenset) -> tuple:
    """The exchanges, in order: round r gives the global values that wait for r exchanges."""
    plans = []
    for r in range(1, max(glob.values(), default=0) + 1):
        exports = tuple(sorted(a for a in flow.exports if flow.cls[a].round == r))
        reductions = tuple(sorted(v for v in flow.reductions if flow.cls[v].round == r))
        values = tuple(sorted(v for v, n in glob.items() if n == r))
        have = {*prog.consts, *(v for v, n in glob.items() if n < r), *exports, *reductions, *shared}
        order = _needed(flow, producers, values, have)
        for k in order:
            if k in flow.rules or any(o is not None and flow.cls[o].unit is not None for o in flow.eqns[k].outvars):
                raise RuntimeError(f"optimizer partition: combine would evaluate `{flow.eqns[k].name}` on a "
                                   f"stage's values (a bug in cfp.runtime.optimizer)")
        read = {a[1] for k in order for a in flow.eqns[k].invars if a[0] == "var"} | set(values)
        plans.append(_Round(exports, reductions, tuple(sorted(read & shared)), values, order))
    return tuple(plans)


@dataclasses.dataclass(frozen=True, eq=False)
class _Analysis:
    """Everything `OptimizerPartition.of` derives from the traced update."""

    leaves: _Leaves
    params_like: Any
    state_keys: tuple          # keystr of each optimizer-state leaf
    state_like: tuple          # ShapeDtypeStruct of each optimizer-state leaf
    state_treedef: Any
    state_cls: tuple           # _Cls of each optimizer-state leaf (its unit, or replicated)
    prog: jxi.OptProgram
    flow: _Flow
    io: _Io
    producers: dict
    glob: dict                 # global value id -> round
    rounds: tuple              # _Round per exchange
    init: "_Init"


def _trace_update(tx: optax.GradientTransformation, params_like, grads_like) -> tuple:
    """(state_like, program) of ``apply_updates(p, tx.update(g, s, p))`` on abstract values."""
    def step(g, s, p):
        updates, new_state = tx.update(g, s, p)
        return optax.apply_updates(p, updates), new_state

    try:
        state_like = jax.eval_shape(tx.init, params_like)
        prog = jxi.trace_whole(step, grads_like, state_like, params_like)
    except Exception as e:   # the user's transformation: report it in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"the optimizer could not be traced on the layered parameters: "
                          f"{type(e).__name__}: {first}") from e
    return state_like, _live(prog)


def _analyse(tx: optax.GradientTransformation, params_like: Any, grads_like: Any) -> _Analysis:
    leaves = _leaf_table(params_like)
    state_like, prog = _trace_update(tx, params_like, grads_like)
    state_flat, state_treedef = jax.tree_util.tree_flatten_with_path(state_like)
    n_p, n_s = len(leaves.names), len(state_flat)
    ins, outs = prog.invars, prog.outvars
    if len(ins) != 2 * n_p + n_s or len(outs) != n_p + n_s:
        raise ConfigError(f"the optimizer's update returns {len(outs) - n_p} state leaves for {n_s} it was given")
    io = _Io(ins[:n_p], ins[n_p:n_p + n_s], ins[n_p + n_s:], outs[:n_p], outs[n_p:])
    flow, state_cls = _fixpoint(prog, leaves, io)
    errors = flow.errors + _output_errors(flow, leaves, io)
    if errors:
        raise ConfigError("the optimizer cannot run per stage: " + errors[0])
    producers = _producers(flow)
    glob = _global_values(prog, flow)
    shared = frozenset(v for v, c in zip(io.state, state_cls) if c.unit is None)
    return _Analysis(
        leaves=leaves, params_like=params_like, state_keys=tuple(jax.tree_util.keystr(p) for p, _ in state_flat),
        state_like=tuple(x for _, x in state_flat), state_treedef=state_treedef, state_cls=state_cls, prog=prog,
        flow=flow, io=io, producers=producers, glob=glob, rounds=_rounds(prog, flow, producers, glob, shared),
        init=_init_analysis(tx, leaves, state_cls))


@dataclasses.dataclass(frozen=True, eq=False)
class _Init:
    """``tx.init`` traced and classified like the update; ``error`` says why a stage cannot run it alone."""

    prog: jxi.OptProgram
    flow: _Flow
    producers: dict
    error: str


def _init_analysis(tx: optax.GradientTransformation, leaves: _Leaves, state_cls: tuple) -> _Init:
    """Each state leaf's initial value must come from its own unit's parameters (or none), with no exchange."""
    params_like = jax.tree_util.tree_unflatten(leaves.treedef, leaves.likes)
    prog = _live(jxi.trace_whole(tx.init, params_like))
    flow = _Walker(prog, leaves).walk({v: _Cls(u, 0, frozenset({i}))
                                       for i, (v, u) in enumerate(zip(prog.invars, leaves.units))})
    errors = list(flow.errors)
    for c, atom in zip(state_cls, prog.outvars):
        got = flow.of(atom)
        if got.round or got.unit not in (None, c.unit):
            errors.append(f"an initial state value depends on {leaves.describe(got.leaves)} or on values "
                          f"exchanged between stages")
    return _Init(prog, flow, _producers(flow), errors[0] if errors else "")


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


class OptimizerPartition:
    """An optax transformation's update on a layered model, split into stages (see the module docstring)."""

    def __init__(self, analysis: _Analysis):
        self._an = analysis
        self._stages: dict[StageHolding, StageOptimizer] = {}
        self._programs: dict = {}      # (unit update's shape, stacked rows, donate) -> its compiled program

    @classmethod
    def of(cls, tx: optax.GradientTransformation, params_like: Any, grads_like: Any = None) -> "OptimizerPartition":
        """Trace ``tx`` on ``params_like`` (``{"first", "layers", "last"}`` of arrays or ShapeDtypeStructs;
        gradients like ``grads_like``, default the same) and prove it runs per stage; `ConfigError` if not."""
        params_like = _abstract(params_like)
        grads_like = params_like if grads_like is None else _abstract(grads_like)
        return cls(_analyse(tx, params_like, grads_like))

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
            env[v] = functools.reduce(_COMBINE[an.flow.reductions[v]], parts)
        _run(an.flow, plan.order, env, None)
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


def _shape(flow: _Flow, consts: dict, order, reads, atoms) -> tuple:
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


def _stage_params_like(leaves: _Leaves, params_like: Any, holding: StageHolding) -> tuple[Any, Any, tuple]:
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

    def __init__(self, an: _Analysis, holding: StageHolding, programs: dict):
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
        order = _needed(an.flow, an.producers, targets, have)
        self._check(an.flow, order)
        reads = {a[1] for k in order for a in an.flow.eqns[k].invars if a[0] == "var"} | set(targets)
        reads = tuple(sorted((reads & have) - set(an.prog.consts)))
        own = {*(io.params[i] for kind, i in leaves if kind == "param"),
               *(io.state[j] for kind, j in leaves if kind == "state" and unit is not None)}
        outs = tuple((like, unit is not None and unit.stacked, an.flow.of(a).unit is None)
                     for (like, unit), a in zip(map(self._like, leaves), atoms))
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
                _run(an.flow, group.order, env, self.holding.rows)
                return tuple(self._output(env, an.flow, atom, unit, like)
                             for atom, (like, unit) in zip(group.atoms, likes))

            self._programs[key] = jax.jit(program, donate_argnums=group.own if donate else ())
        return self._programs[key]

    def _partial_plan(self, r: int, plan: _Round) -> _StagePartial:
        an, holds = self._an, self.holding.holds
        exports = tuple((a, an.flow.exports[a]) for a in plan.exports if holds(an.flow.cls[an.flow.exports[a]].unit))
        reductions = plan.reductions if holds(_STACKED) else ()
        earlier = tuple(v for v, n in an.glob.items() if n <= r)
        order = _needed(an.flow, an.producers, [v for _, v in exports] + list(reductions), self._inputs | set(earlier))
        self._check(an.flow, order)
        return _StagePartial(exports, reductions, plan.shared, order, earlier)

    def _check(self, flow: _Flow, order) -> None:
        """Every equation a stage runs is on its own units or replicated values."""
        for k in order:
            units = {flow.cls[o].unit for o in flow.eqns[k].outvars if o is not None}
            if k in flow.rules and not self.holding.holds(_STACKED) or not all(map(self.holding.holds, units)):
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
        _run(self._an.flow, plan.order, env, self.holding.rows)
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

    def _output(self, env: dict, flow: _Flow, atom, unit: Unit | None, like) -> Any:
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
        order = _needed(init.flow, init.producers, [a[1] for a in outs if a[0] == "var"], set(env))
        self._check(init.flow, order)
        _run(init.flow, order, env, self.holding.rows)
        return {an.state_keys[j]: self._output(env, init.flow, a, an.state_cls[j].unit,
                                               self.state_like[an.state_keys[j]]) for j, a in zip(self._held, outs)}
