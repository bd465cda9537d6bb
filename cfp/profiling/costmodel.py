"""Cost models: the `estimate` profiler's time of a compiled program, and the analytic pre-ranking of strategies.

Collective times come from `cfp.hardware.collectives` (ring model). Compute is roofline:
max(FLOPs / peak, bytes / memory bw).
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from cfp.analysis.analysis import Analysis
from cfp.analysis.blocks import loops_of
from cfp.analysis.layout import BlockLayout
from cfp.hardware.collectives import collective_time
from cfp.hardware.gpus import GpuSpec

# Ranking only needs relative costs; the default ranks with the most common training GPU's ratios.
DEFAULT_RANKING_GPU = "A100-SXM-80G"


def comm_time(collectives: Iterable[tuple[str, int, int]], gpu: GpuSpec) -> float:
    return sum(collective_time(k, b, n, gpu.link_gbps * 1e9) for k, b, n in collectives)


def compute_time(flops: float, bytes_accessed: float, gpu: GpuSpec, dtype: str) -> float:
    return max(flops / gpu.peak_flops(dtype), bytes_accessed / (gpu.mem_gbps * 1e9))


def group_size(axes: Sequence[int], mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape[a] for a in axes) if axes else 1


def dominant_dtype(analysis: Analysis, blocks: Iterable[int]) -> str:
    g = analysis.graph
    counts: dict[str, int] = {}
    for b in blocks:
        op = g.operators[analysis.blocks[b].forward.op]
        dt = g.tensor(op.outputs[0]).dtype
        counts[dt] = counts.get(dt, 0) + 1
    return max(counts, key=counts.get) if counts else "float32"


def block_cost(analysis: Analysis, layout: BlockLayout, gpu: GpuSpec) -> float:
    """Analytic seconds of one block under its layout: its dots' FLOPs per device plus predicted collectives."""
    g = analysis.graph
    shape = analysis.mesh.shape
    block = analysis.blocks[layout.block]
    fwd = block.strategies[layout.strategy]
    t = 0.0
    for bd in block.dots:
        op = g.operators[bd.op]
        loops = loops_of(op, g)
        s = bd.strategy(fwd)
        shards = math.prod(group_size(s.axes_of_loop(i), shape) for i in range(len(loops)))
        flops = 2.0 * math.prod(l.size for l in loops) / shards
        t += flops / gpu.peak_flops(g.tensor(op.outputs[0]).dtype)
    for c in layout.collectives:
        kind = "all-reduce" if c.kind == "all-reduce" else "all-gather"
        t += collective_time(kind, c.bytes, group_size(c.axes, shape), gpu.link_gbps * 1e9)
    return t


def reshard_cost(analysis: Analysis, a: BlockLayout | dict, b: BlockLayout | dict, link_bytes_per_s: float) -> float:
    """All-gather estimate for every tensor two layouts shard differently: (n-1)/n · bytes / link bandwidth."""
    sa = a if isinstance(a, dict) else a.spec_of
    sb = b if isinstance(b, dict) else b.spec_of
    shape = analysis.mesh.shape
    t = 0.0
    for tid in sa.keys() & sb.keys():
        if sa[tid] != sb[tid]:
            xa, xb = {x for d in sa[tid] for x in d}, {x for d in sb[tid] for x in d}
            moved = (xa ^ xb) or (xa | xb)   # same axes on other dims: still a full exchange over them
            t += collective_time("all-gather", analysis.graph.tensor(tid).nbytes,
                                 group_size(tuple(sorted(moved)), shape), link_bytes_per_s)
    return t
