"""The profile cache key: a hash of everything that changes the profiled costs of one segment.

That is the segment's sub-program (every operator with its params, sub-jaxprs and literals, the types of its
operands and results, how they are wired, which block each operator belongs to, which inputs are step inputs),
the layouts of every strategy of its blocks, the mesh (shape and axis names), the device kind, the profiler and
its options, XLA flags and the cfp/jax/jaxlib versions. Tensors are numbered in order of first use inside the
segment, so the same layer in another program (more layers, another head) still hits; anything else misses.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os

import jax
import jaxlib

from cfp.analysis.analysis import Analysis
from cfp.analysis.blocks import data_parallel_choice
from cfp.analysis.segments import Segment
from cfp.ir.capture import Program
from cfp.profiling.options import ProfileOptions
from cfp.profiling.subprogram import segment_io
import cfp.version as version


class _Names:
    """Segment-local tensor names (with their types) in order of first use."""

    def __init__(self, graph):
        self.graph, self.local = graph, {}

    def __call__(self, t: int | None) -> str:
        if t is None:
            return "_"
        if t not in self.local:
            self.local[t] = f"t{len(self.local)}:{self.graph.tensor(t).short()}"
        return self.local[t]


def segment_program_text(program: Program, analysis: Analysis, segment: Segment) -> str:
    """The segment's sub-program and its blocks' layouts under every strategy, in position-free text."""
    g = analysis.graph
    io = segment_io(analysis, segment)
    name = _Names(g)
    flat = set(g.inputs)
    lines = [f"in {name(t)} {'step' if t in flat else 'activation'}" for t in io.inputs]
    block_of = {o: b - segment.start for b in segment.blocks for o in analysis.blocks[b].operators}
    for o in io.ops:
        op = g.operators[o]
        ins = ",".join(map(name, op.inputs))
        outs = ",".join(map(name, op.outputs))
        lines.append(f"b{block_of[o]} {program.operator_text(o)} ({ins}) -> ({outs}) backward={op.backward}")
    lines.append("out " + ",".join(map(name, io.outputs)))
    dp = data_parallel_choice(g, analysis.blocks)
    for b in segment.blocks:
        lines.append(f"block {b - segment.start} data-parallel strategy {dp[b]}")
        for s in range(len(analysis.blocks[b].strategies)):
            lay = analysis.layout(b, s)
            specs = sorted((name(t), spec) for t, spec in lay.specs)
            lines.append(f"  strategy {s}: {specs}")
    return "\n".join(lines)


def profile_settings(options: ProfileOptions) -> str:
    """The profiler and every option that changes its figures (not where they are cached or shown)."""
    d = dataclasses.asdict(options)
    for k in ("cache_dir", "progress"):
        d.pop(k)
    d["kind"] = options.kind.value
    return repr(sorted(d.items()))


def segment_cache_key(program: Program, analysis: Analysis, segment: Segment, options: ProfileOptions,
                      device_kind: str) -> str:
    """The cache file name of `segment`'s profile: a hash of its program text, mesh, device, profiler and
    versions (see the module docstring)."""
    parts = [segment_program_text(program, analysis, segment),
             f"mesh {analysis.mesh.shape} axes {analysis.mesh.axis_names}",
             f"device {device_kind} x{jax.device_count()}",
             f"profiler {profile_settings(options)}",
             f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
             f"cfp {version.__version__} jax {jax.__version__} jaxlib {jaxlib.__version__}"]
    return "seg-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
