"""A segment's sub-program: the segment's operators extracted from the captured step into their own function.

Inputs are the tensors the segment reads but does not produce (flat step inputs, constants, values of other
segments); outputs are the tensors it produces that something outside reads. Inputs and outputs are sharded as
the segment's block layouts imply, and in-segment tensors are constrained by the same `ConstraintHooks` as
`apply.ShardedStep`, so profiling one segment measures the same partitioned code the whole plan would run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from cfp.analysis.analysis import Analysis
from cfp.analysis.loops import outer_source
from cfp.sharding.constraints import ConstraintHooks
from cfp.sharding.specs import partition_spec
from cfp.analysis.layout import BlockLayout, shards
from cfp.analysis.segments import Segment
from cfp.ir.capture import Program


@dataclasses.dataclass(frozen=True)
class SegmentIO:
    """Which tensors a segment reads from outside and which it hands to the outside."""

    ops: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def segment_io(analysis: Analysis, segment: Segment) -> SegmentIO:
    """A loop body's segment keeps the operators run `repeat` times per step (one iteration of its scans,
    forward and backward): its stacked parameters' optimizer update outside the loop is left out, as every
    segment leaves out the remainder."""
    g = analysis.graph
    ops = sorted(o for b in segment.blocks for o in analysis.blocks[b].operators
                 if g.repeat(o) == segment.repeat)
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
    return SegmentIO(tuple(ops), tuple(inputs), tuple(outputs))


def layouts_for(analysis: Analysis, segment: Segment, choice: Sequence[int]) -> tuple[BlockLayout, ...]:
    return tuple(analysis.layout(b, c) for b, c in zip(segment.blocks, choice))


class SegmentProgram:
    """The jitted sub-program of `segment` under strategy combination `choice` (one index per block)."""

    def __init__(self, program: Program, analysis: Analysis, segment: Segment, choice: Sequence[int],
                 mesh: jax.sharding.Mesh):
        self.segment, self.choice, self.mesh = segment, tuple(choice), mesh
        g = analysis.graph
        io = segment_io(analysis, segment)
        self.io = io
        names = analysis.mesh.axis_names
        layouts = layouts_for(analysis, segment, choice)
        hooks = ConstraintHooks(analysis, layouts, mesh)
        first_spec: dict[int, Any] = {}
        for lay in layouts:
            for t, spec in lay.specs:
                first_spec.setdefault(t, spec)
        self.in_shardings = tuple(NamedSharding(mesh, partition_spec(first_spec.get(t, ()), names))
                                  for t in io.inputs)
        self.out_shardings = tuple(NamedSharding(mesh, partition_spec(first_spec.get(t, ()), names))
                                   for t in io.outputs)
        # Activations produced by another segment are that segment's outputs: count them there only (a loop
        # body's slice of a step input, e.g. one layer's weights, is the step's own)
        flat_inputs = set(g.inputs)
        self.borrowed_bytes = sum(
            g.tensor(t).nbytes // max(1, shards(first_spec.get(t, ()), analysis.mesh.shape))
            for t in io.inputs if outer_source(g, t) not in flat_inputs)
        in_ids, out_ids, ops = io.inputs, io.outputs, io.ops

        def fn(*vals):
            env = program.evaluate(dict(zip(in_ids, vals)), ops, hooks.on_output, hooks.scope_of, hooks.on_input)
            return tuple(env[t] for t in out_ids)

        self._jitted = jax.jit(fn, in_shardings=self.in_shardings, out_shardings=self.out_shardings)
        self._avals = tuple(jax.ShapeDtypeStruct(g.tensor(t).shape, np.dtype(g.tensor(t).dtype)
                                                 if g.tensor(t).dtype != "bfloat16" else jax.numpy.bfloat16)
                            for t in io.inputs)

    def compile(self):
        """Lower and compile against abstract inputs (no data needed)."""
        return self._jitted.lower(*self._avals).compile()

    def example_inputs(self) -> tuple:
        """Zero-filled inputs placed with the input shardings (values do not change the timing of dense code)."""
        return tuple(jax.device_put(np.zeros(a.shape, a.dtype), s) for a, s in zip(self._avals, self.in_shardings))
