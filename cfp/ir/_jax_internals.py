"""The one place where cfp touches JAX internals (`jax.extend`, `jax.core`, `jax._src`).

Alpa died of spreading internals over half its files and monkey-patching JAX; cfp keeps every such use here,
behind a small surface: trace a function to a jaxpr, flatten it (inlining call-like primitives), describe each
equation with plain Python values, and re-bind equations when replaying a program. `tests/test_internals_boundary.py`
enforces that no other module imports these names.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.extend.core as jex_core
from jax._src import source_info_util

# Primitives whose sub-jaxpr is a plain call: inlining them keeps the program's meaning (we are past
# differentiation, so custom_jvp/custom_vjp rules are no longer needed: only their primal body runs).
_CALL_JAXPR_PARAM = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "custom_lin": None,  # never appears after linearize+transpose; listed so it is reported, not mis-inlined
}

# Control flow cfp keeps as one opaque operator (its body is not analysed, but it still runs on replay).
OPAQUE_PRIMITIVES = frozenset({"scan", "while", "cond", "shard_map", "xla_pmap", "pmap", "custom_transpose_call"})


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


def trace(fn: Callable, *args) -> TracedProgram:
    """Trace `fn(*args)` to a closed jaxpr and flatten it."""
    flat_args, in_tree = jax.tree_util.tree_flatten(args)

    def flat_fn(*flat):
        return fn(*jax.tree_util.tree_unflatten(in_tree, flat))

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
    return _flatten(closed, in_tree, jax.tree_util.tree_structure(out_shape))


def _aval_info(aval) -> tuple[tuple[int, ...], str]:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    dtype = str(getattr(aval, "dtype", "token"))
    return shape, dtype


def _name_stack_parts(name_stack) -> tuple[tuple[str, ...], tuple[str, ...]]:
    scopes, transforms = [], []
    for entry in getattr(name_stack, "stack", ()):
        if isinstance(entry, source_info_util.Transform):
            transforms.append(entry.name)
        else:
            scopes.append(entry.name)
    return tuple(scopes), tuple(transforms)


def _user_source(source_info) -> tuple[str, tuple]:
    frame = source_info_util.user_frame(source_info.traceback)
    if frame is None:
        return "", ()
    return (f"{frame.file_name}:{frame.start_line} ({frame.function_name})",
            (frame.file_name, frame.start_line, frame.start_column))


def _flatten(closed, in_tree, out_tree) -> TracedProgram:
    avals: dict[int, tuple] = {}
    const_values: dict[int, Any] = {}
    eqns: list[FlatEqn] = []
    counter = [0]

    def new_id(aval) -> int:
        counter[0] += 1
        avals[counter[0]] = _aval_info(aval)
        return counter[0]

    def atom(env, a):
        if isinstance(a, jex_core.Literal):
            return ("lit", a.val)
        return ("var", env[a])

    def walk(jaxpr, env, outer_scope, outer_transforms):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            scopes, transforms = _name_stack_parts(eqn.source_info.name_stack)
            scope = outer_scope + scopes
            trans = outer_transforms + transforms
            ins = [atom(env, v) for v in eqn.invars]
            sub_param = _CALL_JAXPR_PARAM.get(name, "")
            sub = eqn.params.get(sub_param) if sub_param else None
            if sub is not None:
                sub_jaxpr = getattr(sub, "jaxpr", sub)
                sub_consts = getattr(sub, "consts", ())
                inner_env = {}
                for v, c in zip(sub_jaxpr.constvars, sub_consts):
                    inner_env[v] = new_id(v.aval)
                    const_values[inner_env[v]] = c
                # custom_jvp/vjp carry extra leading const operands for their rule functions only
                n_skip = len(ins) - len(sub_jaxpr.invars)
                for v, a in zip(sub_jaxpr.invars, ins[n_skip:]):
                    if a[0] == "var":
                        inner_env[v] = a[1]
                    else:
                        inner_env[v] = new_id(v.aval)
                        const_values[inner_env[v]] = a[1]
                walk(sub_jaxpr, inner_env, scope, trans)
                for outer_v, inner_v in zip(eqn.outvars, sub_jaxpr.outvars):
                    if isinstance(outer_v, jex_core.DropVar):
                        continue
                    if isinstance(inner_v, jex_core.Literal):
                        env[outer_v] = new_id(outer_v.aval)
                        const_values[env[outer_v]] = inner_v.val
                    else:
                        env[outer_v] = inner_env[inner_v]
                continue
            outs = []
            for v in eqn.outvars:
                if isinstance(v, jex_core.DropVar):
                    outs.append(None)
                else:
                    env[v] = new_id(v.aval)
                    outs.append(env[v])
            source, key = _user_source(eqn.source_info)
            eqns.append(FlatEqn(eqn.primitive, dict(eqn.params), ins, outs, scope, trans, source, key))

    env: dict = {}
    jaxpr = closed.jaxpr
    for v, c in zip(jaxpr.constvars, closed.consts):
        env[v] = new_id(v.aval)
        const_values[env[v]] = c
    invars = []
    for v in jaxpr.invars:
        env[v] = new_id(v.aval)
        invars.append(env[v])
    walk(jaxpr, env, (), ())
    outvars = [atom(env, v) for v in jaxpr.outvars]
    return TracedProgram(avals, invars, outvars, eqns, in_tree, out_tree, const_values)


def bind(eqn: FlatEqn, values: Sequence[Any]) -> list:
    """Evaluate one equation on concrete or traced values; always returns a list of outputs."""
    out = eqn.primitive.bind(*values, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def sub_jaxpr_params(eqn: FlatEqn) -> Iterator[str]:
    """Names of params holding sub-jaxprs (for reporting opaque control flow)."""
    for k, v in eqn.params.items():
        if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
            yield k


def named_scope(name: str):
    """Public API re-export so replayed HLO carries cfp's block names in its metadata."""
    return jax.named_scope(name)


def backends_are_initialized() -> bool:
    """Whether JAX has created its backends (after which device-count flags no longer apply)."""
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()
