"""Whole-step figures of a program with seen-through scans.

XLA's cost analysis and the partitioned HLO count a while loop's body once, whatever its trip count (a 4-layer
scanned transformer's compiled step reports about a third of its FLOPs). The body's segments were profiled
for one iteration, so a whole step's FLOPs and its `estimate` time get `repeat - 1` more of each body
segment's figures under the plan's choice; a choice the profile lacks is compiled for the purpose.
"""
from __future__ import annotations

from typing import Sequence

from cfp.analysis.analysis import Analysis
from cfp.hardware.gpus import GpuSpec
from cfp.ir.capture import Program
from cfp.profiling import costmodel
from cfp.profiling.subprogram import SegmentProgram
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
        """(estimated seconds, per-device FLOPs) of one iteration of a body segment under `sub`."""
        key = (seg.kind, sub)
        if key not in self._cache:
            prof = self.table.segments.get(seg.kind)
            entry = next((e for e in prof.entries if tuple(e.choice) == sub), None) if prof else None
            if entry is not None and (self.gpu is None or entry.measured is None):
                self._cache[key] = (entry.time, entry.flops)
            else:
                a = self.analysis
                fig = compiled_figures(SegmentProgram(self.program, a, seg, sub, self.mesh).compile(), a.mesh.shape)
                t = 0.0
                if self.gpu is not None:
                    dtype = costmodel.dominant_dtype(a, seg.blocks)
                    t = costmodel.estimated_time(fig, a.mesh.shape, self.gpu, dtype,
                                                 costmodel.dots_rate(a, zip(seg.blocks, sub), self.gpu))
                self._cache[key] = (t, fig.flops)
        return self._cache[key]
