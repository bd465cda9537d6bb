"""Capture: trace a training step into an `OpGraph`, and replay it with hooks (used to apply shardings)."""
from __future__ import annotations

import json
import numbers
from typing import Any, Callable

import jax

from cfp.errors import CaptureError
from cfp.ir import _jax_internals as internals
from cfp.ir.graph import DotDims, OpGraph, Operator, Tensor


def _param_value(v: Any) -> str | None:
    """A JSON rendering of simple params (ints, tuples, strings); None for anything else (jaxprs, meshes)."""
    def plain(x):
        if isinstance(x, (bool, str)) or x is None:
            return x
        if isinstance(x, numbers.Integral):
            return int(x)
        if isinstance(x, numbers.Real):
            return float(x)
        if isinstance(x, (tuple, list)):
            items = [plain(i) for i in x]
            return items if all(i is not _SKIP for i in items) else _SKIP
        return _SKIP
    p = plain(v)
    if p is _SKIP:
        text = str(v)
        return json.dumps(text) if len(text) < 200 and "{" not in text else None
    return json.dumps(p)


_SKIP = object()


class Program:
    """A captured step: the serialisable `graph` plus what is needed to run it again."""

    def __init__(self, traced: internals.TracedProgram, graph: OpGraph):
        self._traced = traced
        self.graph = graph

    @property
    def in_tree(self):
        return self._traced.in_tree

    @property
    def out_tree(self):
        return self._traced.out_tree

    def replay(self, flat_args: list, on_output: Callable[[int, int, Any], Any] | None = None,
               scope_of: Callable[[int], str | None] | None = None,
               on_input: Callable[[int, int, Any], Any] | None = None) -> list:
        """Evaluate the flat program on `flat_args` (concrete or traced).

        `on_output(op_index, tensor_id, value)` may replace an operator's output (e.g. with a sharding
        constraint) for all its uses; `on_input(op_index, tensor_id, value)` replaces one use only;
        `scope_of(op_index)` names a `jax.named_scope` to emit the operator under, so the compiled
        HLO's metadata says which ParallelBlock each instruction (and each inserted collective) came from.
        """
        t = self._traced
        if len(flat_args) != len(t.invars):
            raise CaptureError(f"replay got {len(flat_args)} flat arguments, the program takes {len(t.invars)}")
        env = self.evaluate(dict(zip(t.invars, flat_args)), range(len(t.eqns)), on_output, scope_of, on_input)
        return [env[a] if kind == "var" else a for kind, a in t.outvars]

    def evaluate(self, values: dict[int, Any], ops, on_output=None, scope_of=None, on_input=None) -> dict:
        """Evaluate operators `ops` (indices, in program order) given the tensors in `values`; returns all
        tensors known afterwards (constants included). Hooks as in `replay`; used to run one segment alone."""
        t = self._traced
        env: dict[int, Any] = dict(t.const_values)
        env.update(values)
        for i in ops:
            eqn = t.eqns[i]
            vals = [env[a] if kind == "var" else a for kind, a in eqn.invars]
            if on_input:
                vals = [on_input(i, a, v) if kind == "var" else v for (kind, a), v in zip(eqn.invars, vals)]
            scope = scope_of(i) if scope_of else None
            if scope:
                with internals.named_scope(scope):
                    outs = internals.bind(eqn, vals)
            else:
                outs = internals.bind(eqn, vals)
            for tid, val in zip(eqn.outvars, outs):
                if tid is not None:
                    env[tid] = on_output(i, tid, val) if on_output else val
        return env

    def replay_part(self, inputs: dict[int, Any], outputs, given: dict[int, Any] | None = None,
                    on_output=None, scope_of=None, on_input=None) -> list:
        """Evaluate only what flat outputs `outputs` (positions) need, from flat inputs `inputs` (position ->
        value) and tensors `given` (tensor id -> value, substituted for what the program would compute;
        passed through `on_output` as if produced). Hooks as in `replay`. Raises CaptureError when the
        outputs need an input that is not given."""
        t = self._traced
        given = dict(given or {})
        values = {t.invars[p]: v for p, v in inputs.items()}
        prod = self.graph.producer
        for tid, v in given.items():
            values[tid] = on_output(prod.get(tid), tid, v) if on_output else v
        wanted = [t.outvars[p] for p in outputs]
        ops = self._cone([a for kind, a in wanted if kind == "var"], set(values))
        env = self.evaluate(values, ops, on_output, scope_of, on_input)
        return [env[a] if kind == "var" else a for kind, a in wanted]

    def _cone(self, tensors, known: set[int]) -> list[int]:
        """Indices (in program order) of the operators computing `tensors` from the `known` ones."""
        prod, consts = self.graph.producer, self._traced.const_values
        ops, seen, stack = set(), set(), list(tensors)
        while stack:
            tid = stack.pop()
            if tid in known or tid in seen:
                continue
            seen.add(tid)
            i = prod.get(tid)
            if i is None:
                if tid not in consts:
                    pos = self.graph.input_position.get(tid)
                    raise CaptureError(f"the requested outputs need flat input {pos} "
                                       f"({self.graph.input_paths[pos] if pos is not None else tid}), "
                                       "which was not given")
                continue
            if i not in ops:
                ops.add(i)
                stack.extend(a for a in self.graph.operators[i].inputs if a is not None)
        return sorted(ops)

    def operator_text(self, index: int) -> str:
        """Operator `index`'s primitive, all its params (bodies of control flow included) and literal inputs as
        text; `graph.operators[index].params` keeps only the simple params."""
        return internals.eqn_text(self._traced.eqns[index])

    def as_function(self, **replay_kwargs) -> Callable:
        """The program as a function of the original (pytree) arguments, returning the original outputs."""
        def fn(*args):
            flat, tree = jax.tree_util.tree_flatten(args)
            if tree != self.in_tree:
                raise CaptureError(f"arguments have structure {tree}, the captured program expects {self.in_tree}")
            return jax.tree_util.tree_unflatten(self.out_tree, self.replay(flat, **replay_kwargs))
        return fn


def capture(fn: Callable, *example_args) -> Program:
    """Trace `fn(*example_args)` (e.g. a whole train step) into a flat `Program`.

    Nested jit, jaxpr calls, custom_jvp/custom_vjp and remat calls are inlined; control flow cfp cannot see through
    (scan, while, cond, shard_map) stays as one opaque operator listed in `graph.opaque_operators`.
    """
    try:
        traced = internals.trace(fn, *example_args)
    except Exception as e:  # a user's function failing to trace is their error, shown in one line
        raise CaptureError(f"could not trace {getattr(fn, '__name__', fn)!r}: {type(e).__name__}: {e}") from e
    tensors = [Tensor(tid, shape, dtype) for tid, (shape, dtype) in sorted(traced.avals.items())]
    ops = []
    for i, eqn in enumerate(traced.eqns):
        name = eqn.primitive.name
        dot = None
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            dot = DotDims(tuple(map(int, lc)), tuple(map(int, rc)), tuple(map(int, lb)), tuple(map(int, rb)))
        params = []
        for k, v in eqn.params.items():
            if k == "dimension_numbers" and dot is not None:
                continue
            rendered = _param_value(v)
            if rendered is not None:
                params.append((k, rendered))
        ops.append(Operator(
            index=i, primitive=name,
            inputs=tuple(a if kind == "var" else None for kind, a in eqn.invars),
            outputs=tuple(eqn.outvars), scope=eqn.scope, source=eqn.source,
            backward="transpose" in eqn.transforms,
            opaque=name in internals.OPAQUE_PRIMITIVES, dot=dot, params=tuple(params),
            recomputed=internals.REMAT_TRANSFORM in eqn.transforms))
    def paths(tree, n):
        leaves = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(tree, list(range(n))))[0]
        return tuple(jax.tree_util.keystr(p) for p, _ in leaves)

    outs = tuple(a if kind == "var" else None for kind, a in traced.outvars)
    graph = OpGraph(tuple(tensors), tuple(ops), tuple(traced.invars), outs,
                    paths(traced.in_tree, len(traced.invars)), paths(traced.out_tree, len(outs)))
    return Program(traced, graph)
