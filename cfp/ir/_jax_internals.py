"""The one place where cfp touches JAX internals (`jax.extend`, `jax.core`, `jax._src`).

Alpa died of spreading internals over half its files and monkey-patching JAX; cfp keeps every such use here,
behind a small surface: trace a function to a jaxpr, flatten it (inlining call-like primitives), describe each
equation with plain Python values, and re-bind equations when replaying a program. `tests/test_internals_boundary.py`
enforces that no other module imports these names.
"""
from __future__ import annotations

import dataclasses
import enum
import math
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
    flat = _Flattener()
    env = flat.consts_of(jaxpr)
    invars = []
    for v in jaxpr.invars:
        env[v] = flat.new_id(v.aval)
        invars.append(env[v])
    flat.walk(jaxpr, env, (), ())
    outvars = [_atom(env, v) for v in jaxpr.outvars]
    return TracedProgram(avals=flat.avals, invars=invars, outvars=outvars, eqns=flat.eqns, in_tree=in_tree,
                         out_tree=out_tree, const_values=flat.const_values, loops=flat.loops)


def _atom(env, a):
    if isinstance(a, jex_core.Literal):
        return ("lit", a.val)
    return ("var", env[a])


class _Flattener:
    """The state of one `_flatten`: global ids handed out so far, their avals and constants, the equations and
    scan regions emitted."""

    def __init__(self):
        self.avals: dict[int, tuple] = {}
        self.const_values: dict[int, Any] = {}
        self.eqns: list[FlatEqn] = []
        self.loops: list[ScanRegion | None] = []
        self.counter = 0

    def new_id(self, aval) -> int:
        self.counter += 1
        self.avals[self.counter] = _aval_info(aval)
        return self.counter

    def consts_of(self, sub) -> dict:
        inner_env = {}
        for v, c in zip(sub.constvars, sub.consts):
            inner_env[v] = self.new_id(v.aval)
            self.const_values[inner_env[v]] = c
        return inner_env

    def bound(self, v, a) -> int:
        """The global id `v` takes for the atom `a`: its var, or a new constant holding its literal."""
        if a[0] == "var":
            return a[1]
        self.const_values[self.new_id(v.aval)] = a[1]
        return self.counter

    def emit(self, primitive, params, ins, outs, eqn, scope, trans, loop):
        """Append one `FlatEqn`, its source taken from the JAX equation `eqn`."""
        source, key = _user_source(eqn.source_info)
        self.eqns.append(FlatEqn(primitive=primitive, params=params, invars=ins, outvars=outs, scope=scope,
                                 transforms=trans, source=source, source_key=key, loop=loop))

    def inline(self, sub, ins, outvars, env, scope, trans, loop):
        """Walk the called jaxpr `sub` with its inputs bound to the caller's operands `ins`."""
        inner_env = self.consts_of(sub)
        # custom_jvp/vjp carry extra leading const operands for their rule functions only
        for v, a in zip(sub.invars, ins[len(ins) - len(sub.invars):]):
            inner_env[v] = self.bound(v, a)
        self.walk(sub, inner_env, scope, trans, loop)
        for outer_v, inner_v in zip(outvars, sub.outvars):
            if not isinstance(outer_v, jex_core.DropVar):
                env[outer_v] = self.bound(outer_v, _atom(inner_env, inner_v))

    def remat_barrier(self, eqn, sub, ins, scope, trans, loop):
        """The operands of a differentiated remat passed through one `optimization_barrier` equation, as JAX
        lowers it (`ad_checkpoint._remat_lowering`); other remats' operands unchanged."""
        cse = eqn.params.get("prevent_cse", True)
        cse = (cse,) * len(ins) if isinstance(cse, bool) else tuple(cse)
        picked = [k for k, (a, keep) in enumerate(zip(ins, cse)) if keep and a[0] == "var"]
        if not eqn.params.get("differentiated") or not picked:
            return ins
        outs = [self.new_id(sub.invars[k].aval) for k in picked]
        self.emit(_optimization_barrier_p(), {}, [ins[k] for k in picked], outs, eqn, scope, trans, loop)
        ins = list(ins)
        for k, o in zip(picked, outs):
            ins[k] = ("var", o)
        return ins

    def scan_region(self, eqn, ins, env, scope, trans, parent):
        """Spell a scan out: an enter port per body input, the body walked once, an exit port per result."""
        body, p = eqn.params["jaxpr"], eqn.params
        nc, nk = _scan_counts(p)
        index = len(self.loops)
        self.loops.append(None)
        port = dict(loop=index, length=int(p["length"]))
        inner_env = self.consts_of(body)
        start, enters = len(self.eqns), []
        for k, (v, a) in enumerate(zip(body.invars, ins)):
            inner_env[v] = self.new_id(v.aval)
            role = "const" if k < nc else "carry" if k < nc + nk else "xs"
            enters.append(len(self.eqns))
            self.emit(SCAN_ENTER, dict(port, role=role), [a], [inner_env[v]], eqn, scope, trans, parent)
        body_start = len(self.eqns)
        self.walk(body, inner_env, scope, trans, index)
        body_stop, exits = len(self.eqns), []
        for k, (outer_v, inner_v) in enumerate(zip(eqn.outvars, body.outvars)):
            out = None
            if not isinstance(outer_v, jex_core.DropVar):
                out = env[outer_v] = self.new_id(outer_v.aval)
            exits.append(len(self.eqns))
            self.emit(SCAN_EXIT, dict(port, role="carry" if k < nk else "ys"), [_atom(inner_env, inner_v)], [out],
                      eqn, scope, trans, parent)
        self.loops[index] = ScanRegion(
            index=index, parent=parent, length=int(p["length"]), reverse=bool(p["reverse"]),
            unroll=p.get("unroll", 1), num_consts=nc, num_carry=nk, enters=tuple(enters), exits=tuple(exits),
            start=start, body_start=body_start, body_stop=body_stop, stop=len(self.eqns))

    def walk(self, jaxpr, env, outer_scope, outer_transforms, loop=None):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            scopes, transforms = _name_stack_parts(eqn.source_info.name_stack)
            scope = outer_scope + scopes
            trans = outer_transforms + transforms
            ins = [_atom(env, v) for v in eqn.invars]
            sub = eqn.params.get(CALL_PRIMITIVES[name]) if name in CALL_PRIMITIVES else None
            if isinstance(sub, jex_core.Jaxpr):
                if name == "remat2":
                    ins = self.remat_barrier(eqn, sub, ins, scope, trans, loop)
                self.inline(sub, ins, eqn.outvars, env, scope, trans, loop)
            elif name == SCAN_PRIMITIVE:
                self.scan_region(eqn, ins, env, scope, trans, loop)
            elif name in IDENTITY_PRIMITIVES:
                for outer_v, a in zip(eqn.outvars, ins):
                    if not isinstance(outer_v, jex_core.DropVar):
                        env[outer_v] = self.bound(outer_v, a)
            else:
                self.equation(eqn, ins, env, scope, trans, loop)

    def equation(self, eqn, ins, env, scope, trans, loop):
        """One plain equation: fresh ids for its outputs (None where dropped)."""
        outs = []
        for v in eqn.outvars:
            if isinstance(v, jex_core.DropVar):
                outs.append(None)
            else:
                env[v] = self.new_id(v.aval)
                outs.append(env[v])
        self.emit(eqn.primitive, dict(eqn.params), ins, outs, eqn, scope, trans, loop)


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


def distributed_client():
    """The coordination service's client of ``jax.distributed.initialize`` (None before it, or without it):
    its ``wait_at_barrier`` is a barrier of a subset of processes with a timeout of the caller's choosing,
    which JAX's public API does not offer."""
    from jax._src import distributed
    return distributed.global_state.client


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def eqn_text(eqn: FlatEqn) -> str:
    """The equation's primitive, every param (sub-jaxprs printed in full) and its literal inputs, object
    addresses removed: equal text on inputs of equal types is the same computation (the profile cache key)."""
    params = ", ".join(f"{k}={v}" for k, v in sorted(eqn.params.items()))
    lits = ", ".join(repr(v) for kind, v in eqn.invars if kind == "lit")
    return _ADDRESS.sub("", f"{eqn.primitive.name}[{params}]({lits})")


# ==============================================================================================================
# Optimizer programs (used by cfp.runtime.optimizer only)
#
# An optax update is traced whole (call-like primitives inlined, `cond` as both branches and a select, `while`
# and `scan` kept as one equation), and its equations are described to the partitioner as plain values. A stage holding layers [a, b) of a layer-stacked
# leaf runs the equations on that leaf's rows only. A value is *layer-aligned* when its dim 0 has size L * K and
# layer l owns rows [l * K, (l + 1) * K) (K = 1 for a stacked leaf; a reshape may flatten the rows of a layer
# into dim 0, as `jnp.vdot` does). `layer_rule` says, from the primitive's params, whether an equation keeps the
# layers' rows independent (ROWS: it runs on any layers' rows with its shape params rewritten, `bind_rows`),
# reduces over them (REDUCE: each stage's partial reduction combines into the whole one), or is refused (REFUSE,
# with the reason).
# ==============================================================================================================


@dataclasses.dataclass(eq=False)
class OptEqn:
    """One equation of a traced optimizer update."""

    primitive: Any            # jax.extend.core.Primitive
    params: dict
    invars: tuple             # per operand: ("var", id) or ("lit", python/numpy value)
    outvars: tuple            # ids (None for dropped outputs)

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclasses.dataclass(eq=False)
class OptProgram:
    """A traced function as `OptEqn`s over integer value ids."""

    avals: dict               # id -> (shape tuple, dtype str)
    invars: tuple             # ids of the flat inputs
    outvars: tuple            # ("var", id) or ("lit", value) per flat output
    eqns: tuple               # tuple[OptEqn, ...]
    consts: dict              # id -> concrete value of a closed-over constant


def trace_whole(fn: Callable, *args) -> OptProgram:
    """Trace `fn(*args)` (pytrees of arrays or `jax.ShapeDtypeStruct`s; nothing is allocated) with call-like
    primitives (`CALL_PRIMITIVES`) inlined, a pure `cond` spelt out (`_WholeWalker._cond`) and every other
    equation -- `scan` and `while` included -- kept as one equation."""
    flat_args, in_tree = jax.tree_util.tree_flatten(args)

    def flat_fn(*flat):
        return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(in_tree, flat)))

    jaxpr = jax.make_jaxpr(flat_fn)(*flat_args)
    return _WholeWalker().program(jaxpr.jaxpr, jaxpr.consts)


class _WholeWalker:
    """Numbers every value of a jaxpr, inlines call-like primitives and spells out conds (`trace_whole`)."""

    def __init__(self):
        self.avals: dict[int, tuple] = {}
        self.consts: dict[int, Any] = {}
        self.eqns: list[OptEqn] = []

    def program(self, jaxpr, consts) -> OptProgram:
        env = self._bind_consts(jaxpr.constvars, consts)
        invars = tuple(self._new(v, env) for v in jaxpr.invars)
        self._walk(jaxpr, env)
        outvars = tuple(self._atom(env, v) for v in jaxpr.outvars)
        return OptProgram(self.avals, invars, outvars, tuple(self.eqns), self.consts)

    def _new(self, v, env) -> int:
        i = len(self.avals) + 1
        self.avals[i] = _aval_info(v.aval)
        env[v] = i
        return i

    def _bind_consts(self, constvars, consts) -> dict:
        env: dict = {}
        for v, c in zip(constvars, consts):
            self.consts[self._new(v, env)] = c
        return env

    def _atom(self, env, a):
        return ("lit", a.val) if isinstance(a, jex_core.Literal) else ("var", env[a])

    def _alias(self, v, atom, env):
        """Bind the inner or outer var `v` to `atom` (a literal becomes a constant)."""
        if isinstance(v, jex_core.DropVar):
            return
        if atom[0] == "var":
            env[v] = atom[1]
        else:
            self.consts[self._new(v, env)] = atom[1]

    def _walk(self, jaxpr, env):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = [self._atom(env, v) for v in eqn.invars]
            sub = eqn.params.get(CALL_PRIMITIVES[name]) if name in CALL_PRIMITIVES else None
            if isinstance(sub, jex_core.ClosedJaxpr):
                sub, sub_consts = sub.jaxpr, sub.consts
            else:
                sub_consts = getattr(sub, "consts", ())
            if isinstance(sub, jex_core.Jaxpr):
                inner = self._bind_consts(sub.constvars, sub_consts)
                # custom_jvp/vjp carry extra leading operands for their rules only
                for v, a in zip(sub.invars, ins[len(ins) - len(sub.invars):]):
                    self._alias(v, a, inner)
                self._walk(sub, inner)
                for outer, v in zip(eqn.outvars, sub.outvars):
                    self._alias(outer, self._atom(inner, v), env)
            elif name in IDENTITY_PRIMITIVES:
                for outer, a in zip(eqn.outvars, ins):
                    self._alias(outer, a, env)
            elif name == "cond" and not eqn.effects and all(_plain_dtype(v.aval) for v in eqn.outvars):
                self._cond(eqn, ins, env)
            else:
                outs = tuple(None if isinstance(v, jex_core.DropVar) else self._new(v, env) for v in eqn.outvars)
                self.eqns.append(OptEqn(eqn.primitive, dict(eqn.params), tuple(ins), outs))

    def _cond(self, eqn, ins, env):
        """A `cond` as every branch inlined and each result picked by the branch index (`select_n`): the same
        values for pure branches (an untaken branch's NaN does not leak through a select), and the partitioner
        sees which unit each result comes from (`optax.apply_if_finite`, `optax.MultiSteps`)."""
        index, args = ins[0], ins[1:]
        results = []
        for branch in eqn.params["branches"]:
            sub, consts = ((branch.jaxpr, branch.consts) if isinstance(branch, jex_core.ClosedJaxpr)
                           else (branch, getattr(branch, "consts", ())))
            inner = self._bind_consts(sub.constvars, consts)
            for v, a in zip(sub.invars, args):
                self._alias(v, a, inner)
            self._walk(sub, inner)
            results.append([self._atom(inner, v) for v in sub.outvars])
        for k, outer in enumerate(eqn.outvars):
            if not isinstance(outer, jex_core.DropVar):
                out = self._new(outer, env)
                self.eqns.append(OptEqn(jax.lax.select_n_p, {}, (index, *(r[k] for r in results)), (out,)))


def _plain_dtype(aval) -> bool:
    """A numeric or boolean array type (not a token or a PRNG key)."""
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def bind_whole(eqn: OptEqn, values: Sequence[Any]) -> list:
    """Evaluate `eqn` as traced (its parameters as `eval_jaxpr` binds them: a `shard_map` rebuilds its function);
    always a list of outputs."""
    out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


class LayerKind(enum.Enum):
    """What an equation with layer-aligned operands does to the layer dim (`layer_rule`)."""

    ROWS = "rows"        # every output is layer-aligned, layers independent: runs on any layers' rows
    REDUCE = "reduce"    # reduces over the layer dim: stage partials combine with `LayerRule.combine`
    REFUSE = "refuse"    # neither (or not known to be): `LayerRule.reason`


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """How an equation with layer-aligned operands runs on a stage's rows of the layer dim."""

    kind: LayerKind
    axes: tuple = ()          # per operand, its layer-aligned axis (None: none); a replicated operand is sliced there
    combine: str = ""         # REDUCE: "add", "max", "min", "mul", "and" or "or"
    reason: str = ""          # REFUSE: why, in a few words


# Primitives applied element by element (rank-0 operands broadcast): rows are independent.
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "bitcast_convert_type",
    "cbrt", "ceil", "clamp", "clz", "complex", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh",
    "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma",
    "igammac", "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "polygamma", "population_count", "pow", "real",
    "reduce_precision", "rem", "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh", "xor", "zeta",
})
_REDUCTIONS = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "mul",
               "reduce_and": "and", "reduce_or": "or"}
# Primitives acting along one dim (param name): rows independent unless that dim is the layer dim.
_ALONG_DIM = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis", "cumlogsumexp": "axis",
              "sort": "dimension", "split": "axis", "concatenate": "dimension"}
# Primitives acting on a set of dims (param name): the same, for every dim of the set.
_ALONG_DIMS = {"argmax": "axes", "argmin": "axes", "squeeze": "dimensions", "rev": "dimensions"}


def layer_rule(eqn: OptEqn, aligned: Sequence[bool], avals: dict, layers: int) -> LayerRule:
    """The rule for `eqn` whose operands flagged in `aligned` are layer-aligned (`layers` layers) on dim 0."""
    shapes = [avals[a[1]][0] if a[0] == "var" else tuple(getattr(a[1], "shape", ())) for a in eqn.invars]
    name, p = eqn.name, eqn.params
    if name in _ELEMENTWISE:
        # size-1 dims broadcast: an operand of size 1 on the layer dim is the same for every layer
        out = avals[eqn.outvars[0]][0] if eqn.outvars[0] is not None else max(shapes, key=len)
        return _rows(tuple(0 if len(s) == len(out) and s[:1] == out[:1] else None for s in shapes))
    if name in _REDUCTIONS:
        if 0 in p["axes"]:
            return LayerRule(LayerKind.REDUCE, (0,), _REDUCTIONS[name])
        return _rows((0,))
    if name == "dot_general":
        return _dot_rule(p["dimension_numbers"], aligned, shapes)
    rule = _shape_rule(name, p, shapes, layers)
    if rule is not None:
        return rule
    if name in _ALONG_DIM or name in _ALONG_DIMS:
        dims = (p[_ALONG_DIM[name]],) if name in _ALONG_DIM else tuple(p[_ALONG_DIMS[name]])
        if 0 in dims:
            return _refuse(f"`{name}` runs along the layer dim")
        return _rows(tuple(0 if len(s) == len(shapes[0]) else None for s in shapes))
    return _refuse(f"`{name}` is not known to keep layers independent")


def _rows(axes: tuple) -> LayerRule:
    return LayerRule(LayerKind.ROWS, axes)


def _refuse(reason: str) -> LayerRule:
    return LayerRule(LayerKind.REFUSE, reason=reason)


def _shape_rule(name: str, p: dict, shapes: list, layers: int) -> LayerRule | None:
    """Rules of the primitives that name output shapes or move dims (None: not one of them)."""
    if name == "broadcast_in_dim":
        ok = len(p["broadcast_dimensions"]) > 0 and p["broadcast_dimensions"][0] == 0
        return _rows((0,) + (None,) * (len(shapes) - 1)) if ok else _refuse("`broadcast_in_dim` moves the layer dim")
    if name == "reshape":
        # row-major: layer l's elements stay one contiguous block, whole rows of the new dim 0 if they divide
        per_layer = math.prod(shapes[0]) // max(layers, 1)
        row = math.prod(p["new_sizes"][1:])
        ok = p.get("dimensions") is None and len(p["new_sizes"]) > 0 and row > 0 and per_layer % row == 0
        return _rows((0,) + (None,) * (len(shapes) - 1)) if ok else _refuse("`reshape` splits a layer's rows")
    if name == "transpose":
        return _rows((0,)) if p["permutation"][0] == 0 else _refuse("`transpose` moves the layer dim")
    if name == "slice":
        strides = p.get("strides") or (1,)
        ok = p["start_indices"][0] == 0 and p["limit_indices"][0] == shapes[0][0] and strides[0] == 1
        return _rows((0,)) if ok else _refuse("`slice` picks some layers")
    if name == "pad":
        ok = tuple(p["padding_config"][0]) == (0, 0, 0)
        return _rows((0, None)) if ok else _refuse("`pad` pads the layer dim")
    return None


def _dot_rule(dimension_numbers, aligned: Sequence[bool], shapes: list) -> LayerRule:
    """dot_general: the layer dim batched first (output dim 0), contracted (a sum over layers), or free on one
    side where it becomes output dim 0; the other operand's paired dim is its layer axis."""
    (lc, rc), (lb, rb) = dimension_numbers
    own = ((tuple(lc), tuple(lb)), (tuple(rc), tuple(rb)))
    axes: list = [None, None]
    kinds = set()
    for k in (0, 1):
        if not aligned[k]:
            continue
        (mine_c, mine_b), (other_c, other_b) = own[k], own[1 - k]
        if mine_b[:1] == (0,):
            partner, kind = other_b[0], LayerKind.ROWS
        elif 0 in mine_c:
            partner, kind = other_c[mine_c.index(0)], LayerKind.REDUCE
        elif not lb and (k == 0 or len(shapes[0]) == len(lc)):
            partner, kind = None, LayerKind.ROWS     # a free dim that leads the output
        else:
            return _refuse("`dot_general` moves the layer dim")
        if aligned[1 - k] and partner != 0:
            return _refuse("`dot_general` pairs the layer dim with another dim")
        axes[k] = 0
        if not aligned[1 - k]:
            axes[1 - k] = partner
        kinds.add(kind)
    if len(kinds) != 1:
        return _refuse("`dot_general` pairs the layer dim with another dim")
    kind = kinds.pop()
    return LayerRule(kind, tuple(axes), "add" if kind is LayerKind.REDUCE else "")


_ROW_SHAPE_PARAMS = {"broadcast_in_dim": "shape", "reshape": "new_sizes", "slice": "limit_indices"}


def bind_rows(eqn: OptEqn, values: Sequence[Any], held: int, layers: int) -> list:
    """Evaluate `eqn` (a ROWS or REDUCE equation) on the rows of `held` of the `layers` layers: the shape it
    names, if any, leads with those layers' rows."""
    params = dict(eqn.params)
    key = _ROW_SHAPE_PARAMS.get(eqn.name)
    if key is not None:
        lead, *rest = params[key]
        params[key] = (lead // layers * held, *rest)
    out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]
