"""How tensor dims flow through an operator: which input dim and output dim are "the same" dim.

A sharding of one dim carries over a link with no communication. Links are what ParallelBlock propagation
walks; reductions over a dim are reported separately because reducing a sharded dim needs an all-reduce.
"""
from __future__ import annotations

import json

from cfp.ir.graph import OpGraph, Operator

# (tensor_a, dim_a, tensor_b, dim_b): dim_a of tensor_a is the same dim as dim_b of tensor_b.
Link = tuple[int, int, int, int]

_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
               "reduce_and", "reduce_or", "reduce_xor"}
# Operators whose output dims are unrelated to their inputs' (or whose sharding semantics we do not model).
_NO_LINKS = {"gather", "scatter", "scatter-add", "scatter_add", "iota", "rng_bit_generator", "sort",
             "random_bits", "random_seed", "random_wrap", "random_unwrap", "threefry2x32", "pad",
             "dynamic_update_slice", "rev", "top_k", "while", "scan", "cond"}


def _param(op: Operator, name: str):
    v = op.param(name)
    return None if v is None else json.loads(v)


def _reshape_links(in_shape, out_shape) -> list[tuple[int, int]]:
    """Pairs (in_dim, out_dim) for the major dim of each group of dims whose sizes multiply to the same."""
    pairs = []
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        while i < len(in_shape) and in_shape[i] == 1:
            i += 1
        while j < len(out_shape) and out_shape[j] == 1:
            j += 1
        if i >= len(in_shape) or j >= len(out_shape):
            break
        pairs.append((i, j))
        pi, pj = in_shape[i], out_shape[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= len(in_shape):
                    return pairs
                pi *= in_shape[i]
                i += 1
            else:
                if j >= len(out_shape):
                    return pairs
                pj *= out_shape[j]
                j += 1
    return pairs


def links(op: Operator, graph: OpGraph) -> list[Link]:
    """Dim links between an operator's tensor inputs and its first output (dots are handled by strategies)."""
    if op.is_dot or op.opaque or op.primitive in _NO_LINKS or not op.outputs or op.outputs[0] is None:
        return []
    out = op.outputs[0]
    out_shape = graph.tensor(out).shape
    ins = [t for t in op.inputs if t is not None]
    name = op.primitive
    result: list[Link] = []
    if op.inputs and op.inputs[0] is None and name not in ("add", "sub", "mul", "div", "max", "min", "select_n"):
        return []  # a literal first operand: nothing to link
    if name == "transpose":
        perm = _param(op, "permutation")
        return [(ins[0], p, out, i) for i, p in enumerate(perm)]
    if name == "broadcast_in_dim":
        bdims = _param(op, "broadcast_dimensions")
        in_shape = graph.tensor(ins[0]).shape
        return [(ins[0], i, out, d) for i, d in enumerate(bdims) if in_shape[i] == out_shape[d]]
    if name == "reshape" or name == "squeeze" or name == "expand_dims":
        return [(ins[0], a, out, b) for a, b in _reshape_links(graph.tensor(ins[0]).shape, out_shape)]
    if name in _REDUCTIONS:
        axes = set(_param(op, "axes") or ())
        kept = [d for d in range(len(graph.tensor(ins[0]).shape)) if d not in axes]
        return [(ins[0], d, out, i) for i, d in enumerate(kept)]
    if name in ("concatenate", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
        skip = _param(op, "dimension") if name == "concatenate" else _param(op, "axis")
        for t in ins:
            if len(graph.tensor(t).shape) == len(out_shape):
                result += [(t, d, out, d) for d in range(len(out_shape)) if d != skip]
        return result
    if name.startswith("reduce_window"):
        # windowed reductions (cumsum lowers to reduce_window_sum) carry only the dims they do not window
        window = _param(op, "window_dimensions")
        if window is not None:
            in_shape = graph.tensor(ins[0]).shape
            return [(ins[0], d, out, d) for d in range(len(out_shape))
                    if window[d] == 1 and in_shape[d] == out_shape[d]]
    if name in ("slice", "dynamic_slice"):
        in_shape = graph.tensor(ins[0]).shape
        return [(ins[0], d, out, d) for d in range(len(out_shape)) if in_shape[d] == out_shape[d]]
    # elementwise (and anything shaped like it): equal-sized dims of same-rank inputs are the output's dims
    # (size-1 dims broadcast implicitly and stay replicated)
    for t in ins:
        shape = graph.tensor(t).shape
        if len(shape) == len(out_shape):
            result += [(t, d, out, d) for d in range(len(out_shape)) if shape[d] == out_shape[d]]
    return result


def reduced_dims(op: Operator, graph: OpGraph) -> tuple[int, tuple[int, ...]] | None:
    """(input tensor, reduced dims) for reductions; a reduced dim that is sharded implies an all-reduce."""
    if op.primitive not in _REDUCTIONS or not op.inputs or op.inputs[0] is None:
        return None
    return op.inputs[0], tuple(_param(op, "axes") or ())
