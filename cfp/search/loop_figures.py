"""Whole-step figures of a program with seen-through scans.

XLA's cost analysis and the partitioned HLO count a while loop's body once, whatever its trip count (a 4-layer
scanned transformer's compiled step reports about a third of its FLOPs). The body's segments were profiled
for one iteration, with their layer's share of the stacked parameters' update (which the compiled step counts
whole, outside the loop), so a whole step's FLOPs and its `estimate` time get `repeat - 1` more of each body
segment's iteration alone under the plan's choice; what the profile lacks is compiled for the purpose.
"""
from __future__ import annotations

from typing import Sequence

from cfp.analysis.analysis import Analysis
from cfp.hardware.gpus import GpuSpec
from cfp.ir.capture import Program
from cfp.profiling import gpu_estimate
from cfp.profiling.subprogram import SegmentPart, SegmentProgram, segment_io
from cfp.profiling.table import ProfileTable
from cfp.xla.compiled import compiled_figures


class LoopBodies:
    """`extra(choice)`: (seconds, per-device FLOPs) a whole step's compiled figures leave out of its loops."""

    def __init__(self, program: Program, analysis: Analysis, table: ProfileTable, gpu: GpuSpec | None, mesh):
        self.program, self.analysis, self.table, self.gpu, self.mesh = program, analysis, table, gpu, mesh
        self._cache: dict[tuple[int, tuple[int, ...]], tuple[float, float]] = {}

    def extra(self, choice: Sequence[int]) -> tuple[float, float]:
        seconds = flops = 0.0
        for seg in self.analysis.segments:
            if seg.repeat > 1:
                t, f = self._iteration(seg, tuple(choice[b] for b in seg.blocks))
                seconds += (seg.repeat - 1) * t
                flops += (seg.repeat - 1) * f
        return seconds, flops

    def _iteration(self, seg, sub: tuple[int, ...]) -> tuple[float, float]:
        """(estimated seconds, per-device FLOPs) of one iteration of a body segment under `sub`, without its
        layer's share of the update."""
        key = (seg.kind, sub)
        if key not in self._cache:
            prof = self.table.segments.get(seg.kind)
            entry = next((e for e in prof.entries if tuple(e.choice) == sub), None) if prof else None
            has_update = bool(segment_io(self.analysis, seg, SegmentPart.UPDATE).ops)
            if entry is not None and self.gpu is None:      # measured: only the FLOPs are added
                update = self._figures(seg, sub, SegmentPart.UPDATE)[1] if has_update else 0.0
                self._cache[key] = (entry.time, entry.flops - update)
            elif entry is not None and entry.measured is None and not has_update:
                self._cache[key] = (entry.time, entry.flops)
            else:
                self._cache[key] = self._figures(seg, sub, SegmentPart.ITERATION)
        return self._cache[key]

    def _figures(self, seg, sub: tuple[int, ...], part: SegmentPart) -> tuple[float, float]:
        """(estimated seconds, per-device FLOPs) of `part` of a body segment, compiled."""
        a = self.analysis
        fig = compiled_figures(SegmentProgram(self.program, a, seg, sub, self.mesh, part).compile(), a.mesh.shape)
        t = 0.0
        if self.gpu is not None:
            dtype = gpu_estimate.dominant_dtype(a, seg.blocks)
            t = gpu_estimate.estimated_time(fig, a.mesh.shape, self.gpu, dtype,
                                         gpu_estimate.dots_rate(a, zip(seg.blocks, sub), self.gpu))
        return t, fig.flops
