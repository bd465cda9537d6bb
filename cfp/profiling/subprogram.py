"""A segment's sub-program: the segment's operators extracted from the captured step into their own function.

Inputs are the tensors the segment reads but does not produce (flat step inputs, constants, values of other
segments); outputs are the tensors it produces that something outside reads. Inputs and outputs are sharded as
the segment's block layouts imply, and in-segment tensors are constrained by the same `ConstraintHooks` as
`apply.ShardedStep`, so profiling one segment measures the same partitioned code the whole plan would run.

A loop body's segment runs one iteration: its body operators (forward and backward), and its layer's share of
the element-wise optimizer update that runs once per step outside the loop on the stacked parameters, computed
on one layer's slice of the stacked tensors. Counted `repeat` times, the segment so costs what its layers cost,
update included.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from cfp.analysis.analysis import Analysis
from cfp.analysis.loops import outer_source, port_role, stacked_dims
from cfp.ir.graph import SCAN_PORTS, OpGraph, Operator
from cfp.sharding.constraints import ConstraintHooks
from cfp.sharding.specs import partition_spec
from cfp.analysis.block_sharding import BlockLayout, shards
from cfp.analysis.segments import Segment
from cfp.ir.capture import Program


class SegmentPart(enum.Enum):
    """What of a loop body's segment a sub-program holds (a segment outside loops has only its iteration)."""

    ALL = "all"               # one iteration and its layer's share of the update: what the profile times
    ITERATION = "iteration"   # the operators run every iteration (what a whole step's figures count once)
    UPDATE = "update"         # the layer's share of the stacked parameters' optimizer update alone


@dataclasses.dataclass(frozen=True)
class SegmentIO:
    """Which tensors a segment reads from outside and which it hands to the outside; `sliced`: (tensor, stacked
    dim) of the stacked tensors the sub-program holds as one layer's slice."""

    ops: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    sliced: tuple[tuple[int, int], ...] = ()


# params that fix an operator's shapes or dims: such an operator cannot run on a slice as it is
_SHAPED_PARAMS = frozenset({"shape", "new_sizes", "dimensions", "broadcast_dimensions", "axes", "permutation",
                            "start_indices", "limit_indices", "strides", "slice_sizes", "dimension",
                            "padding_config", "dimension_numbers"})


def _layer_share(g: OpGraph, op: Operator, stacked: dict, repeat: int) -> dict[int, int] | None:
    """{tensor: stacked dim} of `op` when it is element-wise over stacked tensors of `repeat` layers per step (an
    optimizer update of stacked parameters): one layer's share is the operator on one slice. None otherwise."""
    if op.primitive in SCAN_PORTS or op.is_dot or op.opaque or any(k in _SHAPED_PARAMS for k, _ in op.params):
        return None
    outs = [t for t in op.outputs if t is not None]
    if not outs:
        return None
    shape = g.tensor(outs[0]).shape
    dims: dict[int, int] = {}
    for t in outs + [t for t in op.inputs if t is not None and g.tensor(t).shape != ()]:
        ds = stacked.get(t, ())
        if g.tensor(t).shape != shape or len(ds) != 1:
            return None
        dims[t] = next(iter(ds))
    if len(set(dims.values())) != 1 or not any(t in dims for t in op.inputs if t is not None):
        return None
    return dims if shape[next(iter(dims.values()))] * g.repeat(op.index) == repeat else None


def _layer_update(g: OpGraph, owned: list[int], repeat: int) -> tuple[list[int], list[int], dict[int, int]]:
    """(update operators, the ports linking them to the body, {tensor: stacked dim}) of a loop body's
    segment, among the operators its blocks own."""
    stacked = stacked_dims(g)
    update, dims = [], {}
    for o in owned:
        share = _layer_share(g, g.operators[o], stacked, repeat)
        if share is not None:
            update.append(o)
            dims.update(share)
    ports = []
    for o in owned:
        op = g.operators[o]
        if op.primitive not in SCAN_PORTS or port_role(op) not in ("xs", "ys"):
            continue
        outer = op.inputs[0] if op.primitive == "scan_enter" else op.outputs[0]
        if outer is not None and dims.get(outer) == 0:
            ports.append(o)
    return update, ports, dims


def segment_io(analysis: Analysis, segment: Segment, part: SegmentPart = SegmentPart.ALL) -> SegmentIO:
    """The segment's operators and boundary tensors. A loop body's segment keeps the operators run `repeat`
    times per step (one iteration of its scans, forward and backward) and, unless `part` says otherwise, its
    layer's share of the stacked parameters' optimizer update outside the loop (on slices); other operators
    outside the loop are left out, as every segment leaves out the remainder."""
    g = analysis.graph
    owned = [o for b in segment.blocks for o in analysis.blocks[b].operators]
    body = [o for o in owned if g.repeat(o) == segment.repeat]
    update, ports, dims = ([], [], {}) if segment.repeat == 1 or part is SegmentPart.ITERATION \
        else _layer_update(g, owned, segment.repeat)
    chosen = {SegmentPart.ALL: body + update + ports, SegmentPart.ITERATION: body, SegmentPart.UPDATE: update}
    ops = sorted(set(chosen[part]))
    opset = set(ops)
    produced = {t for o in ops for t in g.operators[o].outputs if t is not None}
    inputs: list[int] = []
    for o in ops:
        for t in g.operators[o].inputs:
            if t is not None and t not in produced and t not in inputs:
                inputs.append(t)
    program_out = {t for t in g.outputs if t is not None}
    outputs = [t for t in sorted(produced)
               if t in program_out or any(c not in opset for c in g.consumers.get(t, ()))]
    sliced = tuple(sorted((t, d) for t, d in dims.items() if t in produced or t in inputs))
    return SegmentIO(tuple(ops), tuple(inputs), tuple(outputs), sliced)


def layouts_for(analysis: Analysis, segment: Segment, choice: Sequence[int]) -> tuple[BlockLayout, ...]:
    return tuple(analysis.layout(b, c) for b, c in zip(segment.blocks, choice))


class SegmentProgram:
    """The jitted sub-program of `segment` under strategy combination `choice` (one index per block); `part`
    picks what of a loop body's segment it holds (see `SegmentPart`)."""

    def __init__(self, program: Program, analysis: Analysis, segment: Segment, choice: Sequence[int],
                 mesh: jax.sharding.Mesh, part: SegmentPart = SegmentPart.ALL):
        self.segment, self.choice, self.mesh = segment, tuple(choice), mesh
        g = analysis.graph
        io = segment_io(analysis, segment, part)
        self.io = io
        sliced = dict(io.sliced)
        names = analysis.mesh.axis_names
        layouts = layouts_for(analysis, segment, choice)
        hooks = ConstraintHooks(analysis, layouts, mesh)
        if sliced:
            hooks = hooks.sliced(sliced)
        first_spec: dict[int, Any] = {}
        for lay in layouts:
            for t, spec in lay.specs:
                first_spec.setdefault(t, _drop(spec, sliced.get(t)))
        self.in_shardings = tuple(NamedSharding(mesh, partition_spec(first_spec.get(t, ()), names))
                                  for t in io.inputs)
        self.out_shardings = tuple(NamedSharding(mesh, partition_spec(first_spec.get(t, ()), names))
                                   for t in io.outputs)
        shape = {t: _drop(g.tensor(t).shape, sliced.get(t)) for t in (*io.inputs, *io.outputs)}
        # Activations produced by another segment are that segment's outputs: count them there only (a loop
        # body's slice of a step input, e.g. one layer's weights, is the step's own)
        flat_inputs = set(g.inputs)
        self.borrowed_bytes = sum(
            int(np.prod(shape[t], dtype=np.int64)) * g.tensor(t).nbytes // max(1, g.tensor(t).size)
            // max(1, shards(first_spec.get(t, ()), analysis.mesh.shape))
            for t in io.inputs if outer_source(g, t) not in flat_inputs)
        in_ids, out_ids, ops = io.inputs, io.outputs, io.ops

        def fn(*vals):
            env = program.evaluate(dict(zip(in_ids, vals)), ops, hooks.on_output, hooks.scope_of, hooks.on_input,
                                   slices=bool(sliced))
            return tuple(env[t] for t in out_ids)

        self._jitted = jax.jit(fn, in_shardings=self.in_shardings, out_shardings=self.out_shardings)
        self._avals = tuple(jax.ShapeDtypeStruct(shape[t], np.dtype(g.tensor(t).dtype)
                                                 if g.tensor(t).dtype != "bfloat16" else jax.numpy.bfloat16)
                            for t in io.inputs)

    def compile(self):
        """Lower and compile against abstract inputs (no data needed)."""
        return self._jitted.lower(*self._avals).compile()

    def example_inputs(self) -> tuple:
        """Zero-filled inputs placed with the input shardings (values do not change the timing of dense code)."""
        return tuple(jax.device_put(np.zeros(a.shape, a.dtype), s) for a, s in zip(self._avals, self.in_shardings))


def _drop(dims: tuple, d: int | None) -> tuple:
    """A shape or per-dim spec without its dim `d` (a stacked tensor's slice); unchanged for None."""
    return dims if d is None or d >= len(dims) else dims[:d] + dims[d + 1:]
