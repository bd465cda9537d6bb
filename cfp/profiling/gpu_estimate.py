"""Cost models: the `estimate` profiler's time of a compiled program, and the analytic pre-ranking of strategies.

Collective times come from `cfp.hardware.collectives` (ring/tree alpha-beta model over the GPU's link). Compute
is a roofline: max(dot FLOPs / achievable rate, bytes / memory bandwidth), where the rate comes from
`cfp.hardware.rates`: the dots' dtype and JAX's matmul precision pick the arithmetic (float32 runs as TF32 on
Ampere/Hopper by default) and each GEMM's per-device shape its achievable fraction of the peak.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

from cfp.analysis.analysis import Analysis
from cfp.analysis.block_sharding import BlockLayout
from cfp.analysis.blocks import loops_of
from cfp.hardware import rates
from cfp.hardware.collectives import LINKS, collective_time, link_collective_time
from cfp.hardware.gpus import GpuSpec
from cfp.sharding.reshard import reshard_steps
from cfp.xla.compiled import CompiledFigures

# Ranking only needs relative costs; the default ranks with the most common training GPU's ratios.
DEFAULT_RANKING_GPU = "A100-SXM-80G"


def matmul_precision():
    """JAX's current default matmul precision (None: the backend default, TF32 on tensor-core GPUs)."""
    import jax
    return jax.config.jax_default_matmul_precision


def collective_seconds(kind: str, nbytes: float, n: int, gpu: GpuSpec) -> float:
    """One collective over the GPU's own link: its catalog link's latencies, the GPU's link bandwidth."""
    link = LINKS.get(gpu.link)
    if link is None:
        return collective_time(kind, nbytes, n, gpu.link_gbps * 1e9)
    if link.gbps != gpu.link_gbps:
        link = dataclasses.replace(link, gbps=gpu.link_gbps)
    return link_collective_time(kind, nbytes, n, link)


def comm_time(collectives: Iterable[tuple[str, int, int]], gpu: GpuSpec) -> float:
    return sum(collective_seconds(k, b, n, gpu) for k, b, n in collectives)


def compute_time(flops: float, bytes_accessed: float, gpu: GpuSpec, dtype: str,
                 rate: float | None = None) -> float:
    """Roofline seconds; `rate` is the dots' achievable FLOP/s (default: a large GEMM in `dtype`)."""
    if rate is None:
        rate = rates.achievable_flops(gpu, rates.dot_precision(dtype, matmul_precision(), gpu))
    return max(flops / rate, rates.memory_time(bytes_accessed, gpu))


def dot_costs(analysis: Analysis, block_strategy: Iterable[tuple[int, int]]):
    """(per-device FLOPs, dtype, per-device GEMM shape (m, n, k)) of every dot of the given (block, strategy)."""
    g, shape = analysis.graph, analysis.mesh.shape
    for b, strategy in block_strategy:
        block = analysis.blocks[b]
        fwd = block.strategies[strategy]
        for bd in block.dots:
            op = g.operators[bd.op]
            loops = loops_of(op, g)
            s = bd.strategy(fwd)
            sizes = [l.size / group_size(s.axes_of_loop(i), shape) for i, l in enumerate(loops)]
            mnk = [math.prod(sz for sz, l in zip(sizes, loops) if l.kind.value == c) for c in "mnk"]
            yield 2.0 * math.prod(sizes), g.tensor(op.inputs[0]).dtype, tuple(max(d, 1.0) for d in mnk)


def dots_rate(analysis: Analysis, block_strategy: Iterable[tuple[int, int]], gpu: GpuSpec) -> float | None:
    """Achievable FLOP/s of the given blocks' dots together (FLOP-weighted; None when there are no dots)."""
    mp = matmul_precision()
    flops = secs = 0.0
    for f, dtype, mnk in dot_costs(analysis, block_strategy):
        flops += f
        secs += rates.dot_time(f, gpu, dtype, mp, mnk)
    return flops / secs if secs > 0 else None


def collective_groups(figures: CompiledFigures, mesh_shape: Sequence[int]) -> tuple[tuple[str, int, int], ...]:
    """(kind, bytes, group size) of every collective of a compiled program."""
    return tuple((c.kind, c.bytes, group_size(c.axes, mesh_shape)) for c in figures.collectives)


def estimated_time(figures: CompiledFigures, mesh_shape: Sequence[int], gpu: GpuSpec, dtype: str,
                   rate: float | None = None) -> float:
    """The `estimate` profiler's seconds of a compiled program: roofline compute (dots at `rate`, see
    `compute_time`) plus its collectives."""
    return (compute_time(figures.flops, figures.bytes_accessed, gpu, dtype, rate)
            + comm_time(collective_groups(figures, mesh_shape), gpu))


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
    mp = matmul_precision()
    t = sum(rates.dot_time(f, gpu, dtype, mp, mnk)
            for f, dtype, mnk in dot_costs(analysis, [(layout.block, layout.strategy)]))
    for c in layout.collectives:
        kind = "all-reduce" if c.kind == "all-reduce" else "all-gather"
        t += collective_seconds(kind, c.bytes, group_size(c.axes, analysis.mesh.shape), gpu)
    return t


def reshard_cost(analysis: Analysis, a: BlockLayout | dict, b: BlockLayout | dict, link_bytes_per_s: float,
                 comm=None) -> float:
    """Seconds to move every tensor two layouts shard differently: the all-gathers and all-to-alls of the
    cheapest single-axis path between its layouts (`cfp.sharding.reshard`), the path the constraints make
    XLA take where it would otherwise replicate the tensor and slice it again. Each collective is priced by
    `comm` (an alpha-beta model, `cfp.hardware.alpha_beta`: latency and bandwidth) where given, else by its
    bytes over `link_bytes_per_s` alone."""
    sa = a if isinstance(a, dict) else a.spec_of
    sb = b if isinstance(b, dict) else b.spec_of
    shape = analysis.mesh.shape
    t = 0.0
    for tid in sa.keys() & sb.keys():
        if sa[tid] != sb[tid]:
            tensor = analysis.graph.tensor(tid)
            for kind, nbytes, n in reshard_steps(sa[tid], sb[tid], tensor.shape, shape, tensor.nbytes):
                t += (comm.time(kind, nbytes, n) if comm is not None
                      else collective_time(kind, nbytes, n, link_bytes_per_s))
    return t
