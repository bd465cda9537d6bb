"""Capture: trace a training step into an `OpGraph`, and replay it with hooks (used to apply shardings)."""
from __future__ import annotations

import json
import numbers
from typing import Any, Callable

import jax

from cfp.errors import CaptureError
from cfp.ir import _jax_internals as internals
from cfp.ir.graph import DotDims, OpGraph, Operator, ScanLoop, Tensor


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

    def evaluate(self, values: dict[int, Any], ops, on_output=None, scope_of=None, on_input=None,
                 slices: bool = False) -> dict:
        """Evaluate operators `ops` (indices, in program order) given the tensors in `values`; returns all
        tensors known afterwards (constants included). Hooks as in `replay`; used to run one segment alone.

        A seen-through scan whose operators are all in `ops` runs as a `jax.lax.scan` (the hooks apply inside
        its body); operators of a loop body given without their loop run once, as one iteration. With
        `slices`, the stacked tensors outside the loop are given and computed as one iteration's slice (a
        layer's weights and its share of their optimizer update): enter and exit ports pass values through."""
        env: dict[int, Any] = dict(self._traced.const_values)
        env.update(values)
        self._run(env, list(ops), _Hooks(on_output, scope_of, on_input, slices))
        return env

    def _run(self, env: dict, ops: list[int], hooks: "_Hooks") -> None:
        wanted, whole = set(ops), {}
        k = 0
        while k < len(ops):
            region = self._whole_region(ops[k], wanted, whole)
            if region is None:
                self._bind(env, ops[k], hooks)
                k += 1
                continue
            self._run_scan(env, region, hooks)
            while k < len(ops) and ops[k] < region.stop:
                k += 1

    def _whole_region(self, i: int, wanted: set, memo: dict):
        """The outermost scan region holding operator `i` (its ports included) whose every operator is wanted."""
        for r in reversed(self._regions_of(i)):
            if r.index not in memo:
                memo[r.index] = all(j in wanted for j in range(r.start, r.stop))
            if memo[r.index]:
                return r
        return None

    def _regions_of(self, i: int) -> list:
        """The scan regions whose span [start, stop) holds operator `i`, innermost first."""
        loops, eqn = self._traced.loops, self._traced.eqns[i]
        out = [loops[eqn.params["loop"]]] if self._is_port(i) else []
        lp = eqn.loop
        while lp is not None:
            out.append(loops[lp])
            lp = loops[lp].parent
        return out

    def _is_port(self, i: int) -> bool:
        return isinstance(self._traced.eqns[i].primitive, internals.ScanPort)

    def _bind(self, env: dict, i: int, hooks: "_Hooks") -> None:
        eqn = self._traced.eqns[i]
        vals = [env[a] if kind == "var" else a for kind, a in eqn.invars]
        if hooks.on_input:
            vals = [hooks.on_input(i, a, v) if kind == "var" else v for (kind, a), v in zip(eqn.invars, vals)]
        scope = hooks.scope_of(i) if hooks.scope_of else None
        if hooks.slices and self._is_port(i):
            outs = vals
        elif scope:
            with internals.named_scope(scope):
                outs = internals.bind(eqn, vals)
        else:
            outs = internals.bind(eqn, vals)
        for tid, val in zip(eqn.outvars, outs):
            if tid is not None:
                env[tid] = hooks.on_output(i, tid, val) if hooks.on_output else val

    def _port_value(self, env: dict, i: int, hooks: "_Hooks"):
        kind, a = self._traced.eqns[i].invars[0]
        if kind != "var":
            return a
        return hooks.on_input(i, a, env[a]) if hooks.on_input else env[a]

    def _set_port(self, env: dict, i: int, value, hooks: "_Hooks") -> None:
        tid = self._traced.eqns[i].outvars[0]
        if tid is not None:
            env[tid] = hooks.on_output(i, tid, value) if hooks.on_output else value

    def _run_scan(self, env: dict, region, hooks: "_Hooks") -> None:
        """Run a seen-through scan as `jax.lax.scan`, its body replayed (with the hooks) inside the loop."""
        t = self._traced
        vals = [self._port_value(env, e, hooks) for e in region.enters]
        nc, nk = region.num_consts, region.num_carry
        consts, init, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
        body_ops = list(range(region.body_start, region.body_stop))

        def body(carry, x):
            benv = dict(t.const_values)
            for e, v in zip(region.enters, (*consts, *carry, *x)):
                self._set_port(benv, e, v, hooks)
            self._run(benv, body_ops, hooks)
            outs = [self._port_value(benv, e, hooks) for e in region.exits]
            return tuple(outs[:nk]), tuple(outs[nk:])

        carry, ys = jax.lax.scan(body, tuple(init), tuple(xs), length=region.length, reverse=region.reverse,
                                 unroll=region.unroll)
        for e, v in zip(region.exits, (*carry, *ys)):
            self._set_port(env, e, v, hooks)

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
            # an operator of a scan brings the whole outermost region around it: the loop runs whole
            regions = self._regions_of(i)
            for j in range(regions[-1].start, regions[-1].stop) if regions else (i,):
                if j not in ops:
                    ops.add(j)
                    stack.extend(a for a in self.graph.operators[j].inputs if a is not None)
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


class _Hooks:
    """The replay hooks of one evaluation (see `Program.replay`)."""

    def __init__(self, on_output, scope_of, on_input, slices: bool = False):
        self.on_output, self.scope_of, self.on_input = on_output, scope_of, on_input
        self.slices = slices      # ports pass one iteration's slice through (see `Program.evaluate`)


def capture(fn: Callable, *example_args) -> Program:
    """Trace `fn(*example_args)` (e.g. a whole train step) into a flat `Program`.

    Nested jit, jaxpr calls, custom_jvp/custom_vjp and remat calls are inlined; a `lax.scan` (`nn.scan`,
    `nnx.scan`, a loop over micro-batches) is seen through: its body's operators appear once, between enter
    and exit ports, and `graph.loops` describes it. Control flow cfp cannot see through (while, cond,
    shard_map) stays as one opaque operator listed in `graph.opaque_operators`.
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
            recomputed=internals.REMAT_TRANSFORM in eqn.transforms, loop=eqn.loop))
    def paths(tree, n):
        leaves = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(tree, list(range(n))))[0]
        return tuple(jax.tree_util.keystr(p) for p, _ in leaves)

    outs = tuple(a if kind == "var" else None for kind, a in traced.outvars)
    loops = tuple(ScanLoop(r.index, r.parent, r.length, r.enters, r.exits, r.start, r.stop) for r in traced.loops)
    graph = OpGraph(tuple(tensors), tuple(ops), tuple(traced.invars), outs,
                    paths(traced.in_tree, len(traced.invars)), paths(traced.out_tree, len(outs)), loops)
    return Program(traced, graph)
