"""Estimates for sharding a block's stored state (ZeRO-3 on top of its strategy), for the search.

Storing a block's parameters and optimizer state sharded over the mesh axes its strategy replicates them on
saves their replicated share per device and costs an all-gather of each parameter its dots read (the
gradient's all-reduce becomes a reduce-scatter of the same size, which the estimate leaves out). The search
adds these to the profiled segment entries, so every candidate combination of strategies also exists with its
state sharded; whole-step verification measures the real figures. The saving counts the state once, though
both the step's arguments and its outputs shrink: gathered parameters and whole gradients take temporaries
instead. Measured on 4-layer models, data parallel with all state sharded saves 0.98x (MoE, 2x4) to 1.23x
(GPT, 2x4) of the one-copy estimate, which is why the search scales the estimate (`scale`) by one whole
compile; under DP x TP the estimate is 2.5-3x too low (known limit: the scale is fitted on data parallel).
"""
from __future__ import annotations

import dataclasses

from cfp.analysis.analysis import Analysis
from cfp.analysis.block_sharding import BlockLayout, shards
from cfp.analysis.blocks import trace_view
from cfp.analysis.loops import stacked_dims
from cfp.sharding.specs import sharded_state_spec, state_owners


@dataclasses.dataclass(frozen=True)
class StateSaving:
    memory: int        # per-device bytes saved
    gathered: int      # per-device bytes received by the all-gathers of parameters before their dots
    gathers: int = 0   # how many tensors those all-gathers move (each one collective)

    def time(self, link_bytes_per_s: float, latency_s: float = 0.0) -> float:
        """Seconds of the all-gathers: their bytes over the link, plus one collective's latency each."""
        return self.gathered / link_bytes_per_s + self.gathers * latency_s


class StateEstimator:
    """`saving(block, strategy)`: what storing that block's state sharded saves and costs."""

    def __init__(self, analysis: Analysis, reference: tuple[int, ...]):
        self.analysis = analysis
        g = analysis.graph
        # which block owns which state tensor barely depends on the strategies: fix it on a reference plan
        layouts = [analysis.layout(b.index, c) for b, c in zip(analysis.blocks, reference)]
        self.owned: dict[int, list[int]] = {}
        for i, b in state_owners(analysis, layouts).items():
            self.owned.setdefault(b, []).append(g.inputs[i])
        self._read_by_dots = {}
        for b in analysis.blocks:
            self._read_by_dots[b.index] = {trace_view(g, t)[0] for d in b.dots
                                           for t in g.operators[d.op].inputs[:2]}
        self._cache: dict[tuple[int, int], StateSaving] = {}
        self.scale = 1.0      # whole-step calibration of the memory savings (set by the search)

    def saving(self, block: int, strategy: int, layout: BlockLayout | None = None) -> StateSaving:
        key = (block, strategy)
        if key not in self._cache:
            g, mesh = self.analysis.graph, self.analysis.mesh.shape
            lay = layout or self.analysis.layout(block, strategy)
            spec_of = lay.spec_of
            memory = gathered = gathers = 0
            for t in self.owned.get(block, ()):
                shape = g.tensor(t).shape
                spec = spec_of.get(t) or tuple(() for _ in shape)
                zero = sharded_state_spec(spec, shape, mesh, stacked_dims(g).get(t, frozenset()))
                before = g.tensor(t).nbytes // shards(spec, mesh)
                after = g.tensor(t).nbytes // shards(zero, mesh)
                memory += before - after
                if t in self._read_by_dots[block] and before > after:
                    gathered += before - after
                    gathers += 1
            self._cache[key] = StateSaving(memory, gathered, gathers)
        return self._cache[key]

    def segment(self, blocks, choice) -> StateSaving:
        parts = [self.saving(b, c) for b, c in zip(blocks, choice)]
        return StateSaving(int(self.scale * sum(p.memory for p in parts)), sum(p.gathered for p in parts),
                           sum(p.gathers for p in parts))
