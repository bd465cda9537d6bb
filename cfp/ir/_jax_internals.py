"""The one place where cfp touches JAX internals (`jax.extend`, `jax.core`, `jax._src`).

Alpa died of spreading internals over half its files and monkey-patching JAX; cfp keeps every such use here,
behind a small surface: trace a function to a jaxpr, flatten it (inlining call-like primitives), describe each
equation with plain Python values, and re-bind equations when replaying a program. `tests/test_internals_boundary.py`
enforces that no other module imports these names.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.extend.core as jex_core
from jax._src import source_info_util

# Call-like primitives of jax 0.12 and the param holding the jaxpr they evaluate. Inlining them keeps the
# program's meaning: we are past differentiation, so custom_jvp/custom_vjp/custom_vmap rules are no longer
# needed (only their primal body runs) and remat's recomputation is already spelt out in the backward pass.
# Remat's memory saving is kept too: JAX lowers a differentiated remat behind one optimization barrier over
# its operands (`_remat_lowering`), which stops XLA from merging the recomputation into the forward pass; the
# flattened program re-emits that barrier as an `optimization_barrier` equation (`graph.BARRIER`). Without
# it a 4-layer remat MLP's gradient (256x256 weights and batch) replayed with 1.57 MB of temporaries vs
# 0.79 MB as written (XLA's memory analysis, measured); with it the replay matches (tests/test_remat.py).
# (Older releases' names -- pjit, closed_call, core_call, custom_vjp_call_jaxpr -- no longer exist: jax 0.12
# aliases closed_call/call to eval_jaxpr. tests/test_capture.py checks that every name here is still emitted.)
CALL_PRIMITIVES = {
    "jit": "jaxpr",                  # a nested jax.jit
    "eval_jaxpr": "call_jaxpr",      # calling a jaxpr or a `jax.jit(f).trace(...)` result
    "remat2": "jaxpr",               # jax.checkpoint / jax.remat, with or without a policy
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vmap_call": "call",
}

# Identities that only mark a value for a transformation already applied (`checkpoint_name` for remat
# policies): dropped, so the value's producer feeds its consumers directly.
IDENTITY_PRIMITIVES = frozenset({"name"})

# Control flow cfp keeps as one opaque operator (its body is not analysed, but it still runs on replay).
# jax 0.12's pmap is a jit around a shard_map. `scan` is seen through instead (`ScanRegion`).
OPAQUE_PRIMITIVES = frozenset({"while", "cond", "shard_map", "custom_linear_solve"})
SCAN_PRIMITIVE = "scan"

# The scope JAX opens around a remat's recomputation (`ad_checkpoint.transpose_jaxpr`): dropped from scopes
# so a recomputed operation keeps its forward scope, and recorded as the pseudo-transform `REMAT_TRANSFORM`.
_REMAT_SCOPE = "rematted_computation"
REMAT_TRANSFORM = "remat"


@dataclasses.dataclass
class FlatEqn:
    """One equation of the flattened program, with JAX objects kept for replay."""

    primitive: Any            # jax.extend.core.Primitive
    params: dict
    invars: list              # per input: ("var", global id) or ("lit", python/numpy value)
    outvars: list             # global ids (None for dropped outputs)
    scope: tuple[str, ...]    # named scopes (Flax module path), transforms stripped
    transforms: tuple[str, ...]  # e.g. ("jvp",) forward, ("jvp", "transpose") backward
    source: str               # "file:line (function)" of the user frame, "" when unknown
    source_key: tuple         # (file, line, column) for matching forward/backward equations
    loop: int | None = None   # the innermost `ScanRegion` whose body holds the equation (None: top level)


class ScanPort:
    """A pseudo-primitive at the boundary of a seen-through `lax.scan`: `scan_enter` gives one body input
    (role const, carry or xs) from the scan's operand, `scan_exit` one result (role carry or ys) from the
    body's output. Replay runs the whole region as a `jax.lax.scan`; bound alone (a loop body's segment
    profiled without its loop) a port computes one iteration's view: the first slice of xs, ys broadcast."""

    multiple_results = False

    def __init__(self, name: str):
        self.name = name

    def bind(self, x, *, role: str, loop: int, length: int):
        if role == "xs":
            return jax.lax.index_in_dim(x, 0, keepdims=False)
        if role == "ys":
            return jax.lax.broadcast(x, (length,))
        return x

    def __repr__(self):
        return self.name


SCAN_ENTER, SCAN_EXIT = ScanPort("scan_enter"), ScanPort("scan_exit")


@dataclasses.dataclass(frozen=True)
class ScanRegion:
    """A `lax.scan` seen through: equations [start, stop) are its enter ports, its body [body_start, body_stop)
    and its exit ports; `parent` is the region whose body holds it (None: top level)."""

    index: int
    parent: int | None
    length: int
    reverse: bool
    unroll: Any
    num_consts: int
    num_carry: int
    enters: tuple[int, ...]   # equation index of the enter port of each body input (consts, carry, xs)
    exits: tuple[int, ...]    # equation index of the exit port of each result (carry, ys)
    start: int
    body_start: int
    body_stop: int
    stop: int


@dataclasses.dataclass
class TracedProgram:
    """A flattened jaxpr: global var ids, avals and equations."""

    avals: dict               # global id -> (shape tuple, dtype str)
    invars: list              # global ids of the flat inputs
    outvars: list             # ("var", id) or ("lit", value) for each flat output
    eqns: list                # list[FlatEqn]
    in_tree: Any
    out_tree: Any
    const_values: dict        # global id -> concrete value of closed-over constants
    loops: list = dataclasses.field(default_factory=list)   # list[ScanRegion], by index


def trace(fn: Callable, *args) -> TracedProgram:
    """Trace `fn(*args)` to a jaxpr and flatten it."""
    flat_args, in_tree = jax.tree_util.tree_flatten(args)

    def flat_fn(*flat):
        return fn(*jax.tree_util.tree_unflatten(in_tree, flat))

    jaxpr, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
    return _flatten(jaxpr, in_tree, jax.tree_util.tree_structure(out_shape))


def _scan_counts(params: dict) -> tuple[int, int]:
    """(consts, carry) operand counts of a scan equation: jax 0.12 keeps them in the flat tree `ft_in`
    (consts, carry, xs) where older releases had `num_consts` and `num_carry`."""
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _aval_info(aval) -> tuple[tuple[int, ...], str]:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    dtype = str(getattr(aval, "dtype", "token"))
    return shape, dtype


def _name_stack_parts(name_stack) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(scopes, transforms) of a name stack.

    A transform entered after a scope re-enters a context that may restate the open scopes: the transposed
    remat of `jvp(T)` is named `transpose(jvp(T))/jvp(T)`. Such a restated prefix is dropped, so backward and
    recomputed operations keep the scope of the forward operation they come from (`T/layers_1/...`)."""
    scopes, transforms = [], []
    restarts: list[int] = []
    after_scope = False
    for entry in getattr(name_stack, "stack", ()):
        if isinstance(entry, source_info_util.Transform):
            transforms.append(entry.name)
            if after_scope:
                restarts.append(len(scopes))
            after_scope = False
        elif entry.name == _REMAT_SCOPE:
            transforms.append(REMAT_TRANSFORM)
        else:
            scopes.append(entry.name)
            after_scope = True
    for r in reversed(restarts):
        k = 0
        while k < r and r + k < len(scopes) and scopes[r + k] == scopes[k]:
            k += 1
        if k == r:      # the whole open path restated
            del scopes[r:r + k]
    return tuple(scopes), tuple(transforms)


def _user_source(source_info) -> tuple[str, tuple]:
    frame = source_info_util.user_frame(source_info.traceback)
    if frame is None:
        return "", ()
    return (f"{frame.file_name}:{frame.start_line} ({frame.function_name})",
            (frame.file_name, frame.start_line, frame.start_column))


def _flatten(jaxpr, in_tree, out_tree) -> TracedProgram:
    """Global ids for every value of `jaxpr` (a jax 0.12 Jaxpr, its consts attached), call-likes inlined,
    scans spelt out as `ScanRegion`s (ports, body once, ports)."""
    avals: dict[int, tuple] = {}
    const_values: dict[int, Any] = {}
    eqns: list[FlatEqn] = []
    loops: list[ScanRegion | None] = []
    counter = [0]

    def new_id(aval) -> int:
        counter[0] += 1
        avals[counter[0]] = _aval_info(aval)
        return counter[0]

    def atom(env, a):
        if isinstance(a, jex_core.Literal):
            return ("lit", a.val)
        return ("var", env[a])

    def consts_of(sub) -> dict:
        inner_env = {}
        for v, c in zip(sub.constvars, sub.consts):
            inner_env[v] = new_id(v.aval)
            const_values[inner_env[v]] = c
        return inner_env

    def inline(sub, ins, outvars, env, scope, trans, loop):
        """Walk the called jaxpr `sub` with its inputs bound to the caller's operands `ins`."""
        inner_env = consts_of(sub)
        # custom_jvp/vjp carry extra leading const operands for their rule functions only
        for v, a in zip(sub.invars, ins[len(ins) - len(sub.invars):]):
            inner_env[v] = bound(v, a)
        walk(sub, inner_env, scope, trans, loop)
        for outer_v, inner_v in zip(outvars, sub.outvars):
            if not isinstance(outer_v, jex_core.DropVar):
                env[outer_v] = bound(outer_v, atom(inner_env, inner_v))

    def bound(v, a) -> int:
        """The global id `v` takes for the atom `a`: its var, or a new constant holding its literal."""
        if a[0] == "var":
            return a[1]
        const_values[new_id(v.aval)] = a[1]
        return counter[0]

    def remat_barrier(eqn, sub, ins, scope, trans, loop):
        """The operands of a differentiated remat passed through one `optimization_barrier` equation, as JAX
        lowers it (`ad_checkpoint._remat_lowering`); other remats' operands unchanged."""
        cse = eqn.params.get("prevent_cse", True)
        cse = (cse,) * len(ins) if isinstance(cse, bool) else tuple(cse)
        picked = [k for k, (a, keep) in enumerate(zip(ins, cse)) if keep and a[0] == "var"]
        if not eqn.params.get("differentiated") or not picked:
            return ins
        outs = [new_id(sub.invars[k].aval) for k in picked]
        source, key = _user_source(eqn.source_info)
        eqns.append(FlatEqn(_optimization_barrier_p(), {}, [ins[k] for k in picked], outs, scope, trans,
                            source, key, loop))
        ins = list(ins)
        for k, o in zip(picked, outs):
            ins[k] = ("var", o)
        return ins

    def scan_region(eqn, ins, env, scope, trans, parent):
        """Spell a scan out: an enter port per body input, the body walked once, an exit port per result."""
        body, p = eqn.params["jaxpr"], eqn.params
        nc, nk = _scan_counts(p)
        index = len(loops)
        loops.append(None)
        source, key = _user_source(eqn.source_info)
        port = dict(loop=index, length=int(p["length"]))
        inner_env = consts_of(body)
        start, enters = len(eqns), []
        for k, (v, a) in enumerate(zip(body.invars, ins)):
            inner_env[v] = new_id(v.aval)
            role = "const" if k < nc else "carry" if k < nc + nk else "xs"
            enters.append(len(eqns))
            eqns.append(FlatEqn(SCAN_ENTER, dict(port, role=role), [a], [inner_env[v]], scope, trans, source, key,
                                parent))
        body_start = len(eqns)
        walk(body, inner_env, scope, trans, index)
        body_stop, exits = len(eqns), []
        for k, (outer_v, inner_v) in enumerate(zip(eqn.outvars, body.outvars)):
            out = None
            if not isinstance(outer_v, jex_core.DropVar):
                out = env[outer_v] = new_id(outer_v.aval)
            exits.append(len(eqns))
            eqns.append(FlatEqn(SCAN_EXIT, dict(port, role="carry" if k < nk else "ys"), [atom(inner_env, inner_v)],
                                [out], scope, trans, source, key, parent))
        loops[index] = ScanRegion(index, parent, int(p["length"]), bool(p["reverse"]), p.get("unroll", 1), nc, nk,
                                  tuple(enters), tuple(exits), start, body_start, body_stop, len(eqns))

    def walk(jaxpr, env, outer_scope, outer_transforms, loop=None):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            scopes, transforms = _name_stack_parts(eqn.source_info.name_stack)
            scope = outer_scope + scopes
            trans = outer_transforms + transforms
            ins = [atom(env, v) for v in eqn.invars]
            sub = eqn.params.get(CALL_PRIMITIVES[name]) if name in CALL_PRIMITIVES else None
            if isinstance(sub, jex_core.Jaxpr):
                if name == "remat2":
                    ins = remat_barrier(eqn, sub, ins, scope, trans, loop)
                inline(sub, ins, eqn.outvars, env, scope, trans, loop)
                continue
            if name == SCAN_PRIMITIVE:
                scan_region(eqn, ins, env, scope, trans, loop)
                continue
            if name in IDENTITY_PRIMITIVES:
                for outer_v, a in zip(eqn.outvars, ins):
                    if not isinstance(outer_v, jex_core.DropVar):
                        env[outer_v] = bound(outer_v, a)
                continue
            outs = []
            for v in eqn.outvars:
                if isinstance(v, jex_core.DropVar):
                    outs.append(None)
                else:
                    env[v] = new_id(v.aval)
                    outs.append(env[v])
            source, key = _user_source(eqn.source_info)
            eqns.append(FlatEqn(eqn.primitive, dict(eqn.params), ins, outs, scope, trans, source, key, loop))

    env: dict = {}
    for v, c in zip(jaxpr.constvars, jaxpr.consts):
        env[v] = new_id(v.aval)
        const_values[env[v]] = c
    invars = []
    for v in jaxpr.invars:
        env[v] = new_id(v.aval)
        invars.append(env[v])
    walk(jaxpr, env, (), ())
    outvars = [atom(env, v) for v in jaxpr.outvars]
    return TracedProgram(avals, invars, outvars, eqns, in_tree, out_tree, const_values, loops)


def _optimization_barrier_p():
    """The barrier primitive (an identity on each operand that XLA may not look through)."""
    return jax.lax.optimization_barrier_p


def bind(eqn: FlatEqn, values: Sequence[Any]) -> list:
    """Evaluate one equation on concrete or traced values; always returns a list of outputs."""
    out = eqn.primitive.bind(*values, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def sub_jaxpr_params(eqn: FlatEqn) -> Iterator[str]:
    """Names of params holding sub-jaxprs (for reporting opaque control flow)."""
    for k, v in eqn.params.items():
        if isinstance(v, jex_core.Jaxpr):
            yield k


def named_scope(name: str):
    """Public API re-export so replayed HLO carries cfp's block names in its metadata."""
    return jax.named_scope(name)


def backends_are_initialized() -> bool:
    """Whether JAX has created its backends (after which device-count flags no longer apply)."""
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def eqn_text(eqn: FlatEqn) -> str:
    """The equation's primitive, every param (sub-jaxprs printed in full) and its literal inputs, object
    addresses removed: equal text on inputs of equal types is the same computation (the profile cache key)."""
    params = ", ".join(f"{k}={v}" for k, v in sorted(eqn.params.items()))
    lits = ", ".join(repr(v) for kind, v in eqn.invars if kind == "lit")
    return _ADDRESS.sub("", f"{eqn.primitive.name}[{params}]({lits})")
