"""From a traced update to its plan: state leaves' units, the global values, the exchange rounds, and the
evaluation of any set of its equations (a stage's, or `combine`'s)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from cfp.errors import ConfigError
from cfp.ir import _jax_internals as jxi
from cfp.runtime.optimizer.flow import GLOBAL_LIMIT, REPL, ValueClass, Flow, Walker
from cfp.runtime.optimizer.param_tree import Leaves, leaf_table

COMBINE: dict[str, Callable] = {"add": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "mul": jnp.multiply,
                                "and": jnp.logical_and, "or": jnp.logical_or}


@dataclasses.dataclass(frozen=True)
class Io:
    """Value ids of the traced update's inputs (gradients, state, parameters) and its outputs."""

    grads: tuple
    state: tuple
    params: tuple
    new_params: tuple     # atoms
    new_state: tuple      # atoms


def live(prog: jxi.OptProgram) -> jxi.OptProgram:
    """The program without equations whose results nothing uses (tracing keeps them; they must not be
    refused for mixing values nobody reads)."""
    used = {a[1] for a in prog.outvars if a[0] == "var"}
    keep = []
    for eqn in reversed(prog.eqns):
        if any(o is not None and o in used for o in eqn.outvars):
            keep.append(eqn)
            used.update(a[1] for a in eqn.invars if a[0] == "var")
    return dataclasses.replace(prog, eqns=tuple(reversed(keep)))


def fixpoint(prog: jxi.OptProgram, leaves: Leaves, io: Io) -> tuple[Flow, tuple]:
    """Classify the update with each state leaf taking the class of its new value, until nothing changes."""
    walker = Walker(prog, leaves)
    params = {v: ValueClass(leaves.units[i], 0, frozenset({i}))
              for ids in (io.grads, io.params) for i, v in enumerate(ids)}
    state = (REPL,) * len(io.state)
    for _ in range(len(io.state) + 2):
        flow = walker.walk({**params, **dict(zip(io.state, state))})
        if flow.errors:     # more local state only adds errors: report the first cause
            return flow, state
        new = tuple(ValueClass(c.unit, 0, c.leaves) if c.unit is not None else REPL
                    for c in map(flow.of, io.new_state))
        if new == state:
            return flow, state
        state = new
    raise ConfigError("optimizer state classes did not settle: its state leaves keep changing unit")


def output_errors(flow: Flow, leaves: Leaves, io: Io) -> list[str]:
    """A new parameter value must come from its own unit's values (and global or replicated ones)."""
    errors = []
    for name, unit, atom in zip(leaves.names, leaves.units, io.new_params):
        c = flow.of(atom)
        if c.unit is not None and c.unit != unit:
            errors.append(f"the new value of {name} depends on {leaves.describe(c.leaves)}, which another stage "
                          f"may hold")
    return errors


def producers_of(flow: Flow) -> dict[int, int]:
    return {o: k for k, eqn in enumerate(flow.eqns) for o in eqn.outvars if o is not None}


def needed(flow: Flow, producers: dict, targets, have) -> tuple[int, ...]:
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


def run_eqns(flow: Flow, order, env: dict, rows: tuple[int, int] | None) -> dict:
    """Evaluate the equations ``order`` into ``env``; equations on stacked values run on the rows of layers
    ``rows`` (their replicated operands sliced to those layers' rows)."""
    for k in order:
        eqn = flow.eqns[k]
        vals = [env[a[1]] if a[0] == "var" else a[1] for a in eqn.invars]
        rule = flow.rules.get(k)
        if rule is None:
            outs = jxi.bind_whole(eqn, vals)
        else:
            vals = [layer_rows(v, axis, rows, flow.layers) if axis is not None and flow.of(a).unit is None else v
                    for v, a, axis in zip(vals, eqn.invars, rule.axes + (None,) * len(vals))]
            outs = jxi.bind_rows(eqn, vals, rows[1] - rows[0], flow.layers)
        for o, v in zip(eqn.outvars, outs):
            if o is not None:
                env[o] = v
    return env


def layer_rows(value, axis: int, rows: tuple[int, int], layers: int):
    """The rows of layers ``rows`` of a layer-aligned ``axis`` (L * K rows, K per layer)."""
    per = value.shape[axis] // layers
    return jax.lax.slice_in_dim(value, rows[0] * per, rows[1] * per, axis=axis)


def global_values(prog: jxi.OptProgram, flow: Flow) -> dict[int, int]:
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
class Round:
    """One exchange of global values: what the stages send (`partials`) and what `combine` computes."""

    exports: tuple            # alias ids exported this round
    reductions: tuple         # reduced value ids combined this round
    shared: tuple             # replicated state input ids `combine` reads (from the first stage's partials)
    values: tuple             # global value ids this round gives
    order: tuple              # equations `combine` evaluates


def rounds_of(prog: jxi.OptProgram, flow: Flow, producers: dict, glob: dict, shared: frozenset) -> tuple:
    """The exchanges, in order: round r gives the global values that wait for r exchanges."""
    plans = []
    for r in range(1, max(glob.values(), default=0) + 1):
        exports = tuple(sorted(a for a in flow.exports if flow.cls[a].round == r))
        reductions = tuple(sorted(v for v in flow.reductions if flow.cls[v].round == r))
        values = tuple(sorted(v for v, n in glob.items() if n == r))
        have = {*prog.consts, *(v for v, n in glob.items() if n < r), *exports, *reductions, *shared}
        order = needed(flow, producers, values, have)
        for k in order:
            if k in flow.rules or any(o is not None and flow.cls[o].unit is not None for o in flow.eqns[k].outvars):
                raise RuntimeError(f"optimizer partition: combine would evaluate `{flow.eqns[k].name}` on a "
                                   f"stage's values (a bug in cfp.runtime.optimizer)")
        read = {a[1] for k in order for a in flow.eqns[k].invars if a[0] == "var"} | set(values)
        plans.append(Round(exports, reductions, tuple(sorted(read & shared)), values, order))
    return tuple(plans)


@dataclasses.dataclass(frozen=True, eq=False)
class Analysis:
    """Everything `OptimizerPartition.of` derives from the traced update."""

    leaves: Leaves
    params_like: Any
    state_keys: tuple          # keystr of each optimizer-state leaf
    state_like: tuple          # ShapeDtypeStruct of each optimizer-state leaf
    state_treedef: Any
    state_cls: tuple           # ValueClass of each optimizer-state leaf (its unit, or replicated)
    prog: jxi.OptProgram
    flow: Flow
    io: Io
    producers: dict
    glob: dict                 # global value id -> round
    rounds: tuple              # Round per exchange
    init: "Init"


def trace_update(tx: optax.GradientTransformation, params_like, grads_like) -> tuple:
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
    return state_like, live(prog)


def analyse(tx: optax.GradientTransformation, params_like: Any, grads_like: Any) -> Analysis:
    leaves = leaf_table(params_like)
    state_like, prog = trace_update(tx, params_like, grads_like)
    state_flat, state_treedef = jax.tree_util.tree_flatten_with_path(state_like)
    n_p, n_s = len(leaves.names), len(state_flat)
    ins, outs = prog.invars, prog.outvars
    if len(ins) != 2 * n_p + n_s or len(outs) != n_p + n_s:
        raise ConfigError(f"the optimizer's update returns {len(outs) - n_p} state leaves for {n_s} it was given")
    io = Io(ins[:n_p], ins[n_p:n_p + n_s], ins[n_p + n_s:], outs[:n_p], outs[n_p:])
    flow, state_cls = fixpoint(prog, leaves, io)
    errors = flow.errors + output_errors(flow, leaves, io)
    if errors:
        raise ConfigError("the optimizer cannot run per stage: " + errors[0])
    producers = producers_of(flow)
    glob = global_values(prog, flow)
    shared = frozenset(v for v, c in zip(io.state, state_cls) if c.unit is None)
    return Analysis(
        leaves=leaves, params_like=params_like, state_keys=tuple(jax.tree_util.keystr(p) for p, _ in state_flat),
        state_like=tuple(x for _, x in state_flat), state_treedef=state_treedef, state_cls=state_cls, prog=prog,
        flow=flow, io=io, producers=producers, glob=glob, rounds=rounds_of(prog, flow, producers, glob, shared),
        init=init_analysis(tx, leaves, state_cls))


@dataclasses.dataclass(frozen=True, eq=False)
class Init:
    """``tx.init`` traced and classified like the update; ``error`` says why a stage cannot run it alone."""

    prog: jxi.OptProgram
    flow: Flow
    producers: dict
    error: str


def init_analysis(tx: optax.GradientTransformation, leaves: Leaves, state_cls: tuple) -> Init:
    """Each state leaf's initial value must come from its own unit's parameters (or none), with no exchange."""
    params_like = jax.tree_util.tree_unflatten(leaves.treedef, leaves.likes)
    prog = live(jxi.trace_whole(tx.init, params_like))
    flow = Walker(prog, leaves).walk({v: ValueClass(u, 0, frozenset({i}))
                                       for i, (v, u) in enumerate(zip(prog.invars, leaves.units))})
    errors = list(flow.errors)
    for c, atom in zip(state_cls, prog.outvars):
        got = flow.of(atom)
        if got.round or got.unit not in (None, c.unit):
            errors.append(f"an initial state value depends on {leaves.describe(got.leaves)} or on values "
                          f"exchanged between stages")
    return Init(prog, flow, producers_of(flow), errors[0] if errors else "")
