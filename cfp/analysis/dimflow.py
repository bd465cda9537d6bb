"""How tensor dims flow through an operator: which input dim and output dim are "the same" dim.

A sharding of one dim carries over a link with no communication. Links are what ParallelBlock propagation
walks; reductions over a dim are reported separately because reducing a sharded dim needs an all-reduce.
"""
from __future__ import annotations

import json

from cfp.ir.graph import BARRIER, SCAN_PORTS, OpGraph, Operator

# (tensor_a, dim_a, tensor_b, dim_b): dim_a of tensor_a is the same dim as dim_b of tensor_b.
Link = tuple[int, int, int, int]

_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
               "reduce_and", "reduce_or", "reduce_xor"}
# Operators whose output dims are unrelated to their inputs' (or whose sharding semantics we do not model).
_NO_LINKS = {"iota", "rng_bit_generator", "sort",
             "random_bits", "random_seed", "random_wrap", "random_unwrap", "threefry2x32",
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


_SCATTERS = {"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
             "scatter-max", "scatter_max"}


def _gather_links(op: Operator, graph: OpGraph) -> list[Link]:
    """gather(operand, indices): the output's batch dims are the indices' dims (but the last, the index
    vector) and, through explicit batching dims, the operand's; its offset dims are the operand's dims that
    are neither collapsed nor batching, where the slice takes the whole dim."""
    dn = _param(op, "dimension_numbers")
    sizes = _param(op, "slice_sizes")
    if not dn or sizes is None or len(op.inputs) < 2 or None in op.inputs[:2]:
        return []
    offset, collapsed, _, op_batch, idx_batch = (list(x) for x in dn)
    operand, indices, out = op.inputs[0], op.inputs[1], op.outputs[0]
    o_shape, i_shape = graph.tensor(operand).shape, graph.tensor(indices).shape
    out_rank = len(graph.tensor(out).shape)
    batch_out = [d for d in range(out_rank) if d not in offset]
    result = [(indices, k, out, d) for k, d in enumerate(batch_out) if k < len(i_shape) - 1]
    result += [(operand, ob, out, batch_out[ib]) for ob, ib in zip(op_batch, idx_batch) if ib < len(batch_out)]
    windowed = [d for d in range(len(o_shape)) if d not in collapsed and d not in op_batch]
    result += [(operand, d, out, od) for d, od in zip(windowed, sorted(offset)) if sizes[d] == o_shape[d]]
    return result


def _scatter_links(op: Operator, graph: OpGraph) -> list[Link]:
    """scatter(operand, indices, updates): the output is the operand dim for dim; the updates' window dims
    are operand dims (where the window spans the whole dim), their scatter dims the indices' dims, and
    explicit batching dims tie updates to operand. Scattered (non-window) dims of the updates are not linked:
    sharding them means partial results, i.e. an all-reduce."""
    dn = _param(op, "dimension_numbers")
    if not dn or len(op.inputs) < 3 or None in op.inputs[:3]:
        return []
    window, inserted, _, op_batch, idx_batch = (list(x) for x in dn)
    operand, indices, updates, out = op.inputs[0], op.inputs[1], op.inputs[2], op.outputs[0]
    o_shape, u_shape = graph.tensor(operand).shape, graph.tensor(updates).shape
    i_rank = len(graph.tensor(indices).shape)
    result = [(operand, d, out, d) for d in range(len(o_shape))]
    scatter_dims = [d for d in range(len(u_shape)) if d not in window]
    result += [(indices, k, updates, d) for k, d in enumerate(scatter_dims) if k < i_rank - 1]
    result += [(updates, scatter_dims[ib], out, ob) for ob, ib in zip(op_batch, idx_batch) if ib < len(scatter_dims)]
    windowed = [d for d in range(len(o_shape)) if d not in inserted and d not in op_batch]
    result += [(updates, ud, out, d) for d, ud in zip(windowed, sorted(window)) if u_shape[ud] == o_shape[d]]
    return result


def _port_links(op: Operator, graph: OpGraph) -> list[Link]:
    """A scan port links its operand and result dim for dim; a stacked one (xs in, ys out) shifts by the
    leading iteration dim, which stays unlinked: no strategy inside the body can shard it."""
    t, out = op.inputs[0], op.outputs[0]
    if t is None or out is None:
        return []
    role = _param(op, "role")
    shift_in, shift_out = (1, 0) if role == "xs" else (0, 1) if role == "ys" else (0, 0)
    rank = len(graph.tensor(t).shape) - shift_in
    return [(t, d + shift_in, out, d + shift_out) for d in range(rank)]


def links(op: Operator, graph: OpGraph) -> list[Link]:
    """Dim links between an operator's tensor inputs and its output (every output of a `split`); dots are
    handled by strategies."""
    if op.primitive in SCAN_PORTS:
        return _port_links(op, graph)
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
    if name == "gather":
        return _gather_links(op, graph)
    if name in _SCATTERS:
        return _scatter_links(op, graph)
    if name == "pad":
        # the transpose of a slice or concatenate: unpadded dims carry over
        config = _param(op, "padding_config")
        return [(ins[0], d, out, d) for d, cfg in enumerate(config) if not any(cfg)]
    if name == BARRIER:
        # an identity on each operand (re-emitted in front of a differentiated remat)
        return [(t, d, o, d) for t, o in zip(op.inputs, op.outputs) if t is not None and o is not None
                for d in range(len(graph.tensor(o).shape))]
    if name == "split":
        # one input, several outputs cut along `axis`: every other dim carries over to each piece
        axis = _param(op, "axis")
        return [(ins[0], d, o, d) for o in op.outputs if o is not None
                for d in range(len(graph.tensor(o).shape)) if d != axis]
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
