"""Measure this host's XLA:CPU devices: the figures of a `CpuCalibration` (GEMM rates and their shape curve,
memory-bound rates either side of the effective cache, softmax, collective costs), as `cfp.hardware.host_entry`
caches them per host and `benchmarks/calibrate_cpu.py` prints (and writes as the catalog's fallback entry).

Every kernel is timed by the CPU time of all the process's threads (`time.process_time`), not wall time: the
devices share the host's cores and one intra-op thread pool (one device's GEMM spreads over every core), so a
kernel's CPU time is the work it gives the host, and it does not grow when other users load the host the way
wall time does (measured: wall time 3x the CPU time at load average 11, CPU time within 5% between runs).
Figures are per core-second; the catalog's per-device figures are cores x per-core / devices.

  * GEMM: float32 (m x k) @ (k x n) on one device for the projection and attention shapes of the zoo's small
    configs, fitted to rate = R d1 d2 d3 / prod(d + H) (`cfp.hardware.rates`) by least squares in log space;
  * softmax: float32 over [b, 128, 128] scores, counted as the cost model counts its bytes (4 passes);
  * the rest of the elementwise work (norms, residuals, activations, RoPE): the rate at which the cost model's
    stage time fits the measured forward + backward of a one-layer Llama-2 stage at several micro-batches (the
    runtime's compiled programs, one copy per core at once), its GEMMs and softmax at the rates above: two
    rates, either side of the working set where it drops (the effective last-level cache, fitted);
  * all-reduce: a psum of B bytes over n devices; its CPU time as the per-device time of all devices busy
    (x devices / (n cores)) fitted to t = latency + 2(n-1)/n B / bandwidth (the ring model of
    `cfp.hardware.collectives` plus a fixed cost per collective: on a CPU a collective is a rendezvous of
    threads and memory copies).

`Size` says how much is measured: `FULL` (the benchmark's), `QUICK` (a host's first use: the stage at four
micro-batches, fewer shapes and repeats) and `TINY` (tests: a tiny stage, one repeat).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from cfp.hardware.calibration import CpuCalibration

# (m, n, k): the projections of Llama-2/GPT "small" (hidden 256, FFN 688/1024) at 2 and 8 sequences of 128 tokens
# and TP 1-8, and thin ones; attention einsums come as batched (b, m, n, k)
GEMMS = ((256, 256, 256), (256, 688, 256), (256, 256, 688), (256, 64, 256), (256, 32, 256), (256, 256, 64),
         (1024, 256, 256), (1024, 688, 256), (1024, 256, 688), (1024, 64, 256), (1024, 32, 256),
         (1024, 2048, 256), (512, 512, 512), (128, 128, 128), (2048, 256, 256))
BATCHED = ((16, 128, 128, 32), (16, 128, 32, 128), (64, 128, 128, 32))
STAGE_MICRO_BATCHES = (1, 2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class Size:
    """How much one measurement runs: repeats per kernel, the GEMM shapes, the stage's config (zoo Llama-2 name,
    layers) and micro-batches (the cache split needs two or more either side), the all-reduce (devices, bytes)."""
    name: str
    repeats: int
    gemms: tuple
    batched: tuple
    stage: tuple            # (llama2 config name, its overrides as (key, value) pairs)
    micro_batches: tuple
    reduces: tuple          # (devices, bytes) pairs

    def __post_init__(self):
        if self.repeats < 1 or len(self.micro_batches) < 2 or not self.gemms or not self.reduces:
            raise ValueError(f"measurement size {self.name!r}: needs repeats >= 1, two micro-batches, a GEMM "
                             f"and an all-reduce")


FULL = Size("full", 9, GEMMS, BATCHED, ("small", (("num_layers", 3),)), STAGE_MICRO_BATCHES,
            tuple((n, b) for n in (2, 4, 8) for b in (1 << 16, 1 << 18, 1 << 20)))
QUICK = Size("quick", 3, GEMMS[:3] + GEMMS[6:9] + GEMMS[11:13], BATCHED[:1] + BATCHED[2:],
             ("small", (("num_layers", 3),)), (1, 2, 4, 8),
             tuple((n, b) for n in (2, 8) for b in (1 << 16, 1 << 20)))
TINY = Size("tiny", 1, ((64, 64, 64), (128, 64, 64), (128, 128, 128)), (), (
    "tiny", (("num_layers", 3), ("seq_len", 32), ("hidden_size", 64), ("num_heads", 4), ("vocab_size", 512),
             ("ffn_size", 128))), (1, 2, 3, 4), ((2, 1 << 14), (2, 1 << 16)))
SIZES = {s.name: s for s in (FULL, QUICK, TINY)}


def cpu_seconds(fn, args, repeats: int) -> float:
    """Median CPU seconds (all threads) of `fn(*args)` after a warm-up call."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        jax.block_until_ready(fn(*args))
        times.append(time.process_time() - c0)
    return statistics.median(times)


def _on(device, shape):
    import jax
    return jax.device_put(np.random.default_rng(0).standard_normal(shape).astype(np.float32), device)


def gemm_points(size: Size) -> list[tuple[tuple[float, float, float], float]]:
    """((m, n, k), FLOPs per CPU second) of each GEMM shape of `size`, on device 0."""
    import jax
    import jax.numpy as jnp
    dev, out = jax.devices()[0], []
    mm = jax.jit(lambda a, b: a @ b)
    for m, n, k in size.gemms:
        t = cpu_seconds(mm, (_on(dev, (m, k)), _on(dev, (k, n))), size.repeats)
        out.append(((m, n, k), 2 * m * n * k / t))
    bmm = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))
    for b, m, n, k in size.batched:
        t = cpu_seconds(bmm, (_on(dev, (b, m, k)), _on(dev, (b, k, n))), size.repeats)
        out.append(((m, n, k), 2 * b * m * n * k / t))
    return out


def fit_gemm(points) -> tuple[float, float]:
    """(large-GEMM FLOPs per CPU second R, half dimension H) of rate = R prod(d / (d + H)): least squares in
    log space, H on a grid (R is then the geometric mean)."""
    shapes = np.array([s for s, _ in points], float)
    log_rate = np.log([r for _, r in points])
    best = None
    for h in np.arange(0.0, 256.5, 0.5):
        curve = np.log(shapes / (shapes + h)).sum(axis=1)
        log_r = float(np.mean(log_rate - curve))
        err = float(np.sum((log_rate - curve - log_r) ** 2))
        if best is None or err < best[0]:
            best = (err, float(np.exp(log_r)), float(h))
    return best[1], best[2]


def memory_rate(repeats: int) -> float:
    """Bytes read + written per CPU second of `x * a + b` in float32, all devices at once (smaller of 1, 4 MiB
    per device): printed for reference beside the stage fit."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("d",))
    k = mesh.devices.size
    f = jax.jit(lambda x: x * 1.0001 + 0.5)
    rates = []
    for elements in (1 << 18, 1 << 20):
        x = jax.device_put(np.ones((k, elements), np.float32), NamedSharding(mesh, P("d")))
        rates.append(2 * 4 * elements * k / cpu_seconds(f, (x,), repeats))
    return min(rates)


def all_reduce_points(size: Size, cores: int) -> list[tuple[int, int, float]]:
    """(n, bytes, per-device seconds with all devices busy) of one psum over the first n devices, inside a
    program (the CPU time of a chain of 17 psums less that of 1, over 16: a program's own launch is not the
    collective's): its CPU time x devices / (n cores), the share of the host a TP group of n holds."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def chain(r):
        def body(v):
            for _ in range(r):
                v = jax.lax.psum(v, "d") * 0.5
            return v
        return body
    out, devices = [], len(jax.devices())
    for n, nbytes in size.reduces:
        if n > devices:
            continue
        mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
        x = jax.device_put(np.ones((n, nbytes // 4), np.float32), NamedSharding(mesh, P("d")))
        t1, t17 = (cpu_seconds(jax.jit(jax.shard_map(chain(r), mesh=mesh, in_specs=P("d"), out_specs=P("d"))),
                               (x,), size.repeats) for r in (1, 17))
        out.append((n, nbytes, max(t17 - t1, 0.0) / 16 * devices / (n * cores)))
    return out


def fit_link(points) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of t = latency + 2(n-1)/n B / bandwidth, least squares."""
    a = np.array([[1.0, 2 * (n - 1) / n * b] for n, b, _ in points])
    t = np.array([s for _, _, s in points])
    (lat, inv_bw), *_ = np.linalg.lstsq(a, t, rcond=None)
    return max(float(lat), 0.0), 1.0 / float(inv_bw)


def softmax_rate(repeats: int) -> float:
    """Bytes per CPU second of a float32 softmax over [b, 128, 128] scores (b = 16 and 64: the heads of 2 and
    8 sequences), counted as the cost model counts them (`ModelCost.layer_score_bytes`: 4 passes of 4 bytes)."""
    import jax
    dev, rates = jax.devices()[0], []
    f = jax.jit(lambda s: jax.nn.softmax(s, axis=-1))
    for b in (16, 64):
        rates.append(4 * 4 * b * 128 * 128 / cpu_seconds(f, (_on(dev, (b, 128, 128)),), repeats))
    return statistics.median(rates)


def stage_config(size: Size):
    from cfp.models import get_config
    name, overrides = size.stage
    return get_config("llama2", name, **dict(overrides))


def stage_points(size: Size, copies: int) -> list[tuple[int, float]]:
    """(micro-batch, CPU seconds per copy) of the forward + backward programs of a middle one-layer Llama-2 stage
    (the runtime's compiled programs, `HeteroTrainer.compile_jobs`) at `size`'s micro-batches, `copies` of it
    (one per core, on distinct devices) run at once as a pipeline's busy stages are: they share the last-level
    cache."""
    from cfp.layout import Layout
    from cfp.models import make_batch
    from cfp.runtime.engine import zoo_trainer
    cfg, out = stage_config(size), []
    for mb in size.micro_batches:
        trainer = zoo_trainer("llama2", cfg, Layout.from_lists(
            [[1, 1, 1]] * copies, [[1, 1, 1]] * copies, [2 * mb] * copies, [2] * copies), abstract=True,
            example_batch=make_batch("llama2", cfg, 1, 0))
        jobs = [trainer.compile_jobs((p, 1))[:2] for p in range(copies)]
        runs = [[(prog.lower(*like).compile(), like) for prog, like in pair] for pair in jobs]
        out.append((mb, sum(_copies_seconds(runs, step, size.repeats) for step in range(2))))
    return out


def _copies_seconds(runs, step: int, repeats: int) -> float:
    """Median CPU seconds per copy of program `step` (0 forward, 1 backward) of every copy run at once, on
    fresh arguments each time (the backward donates some)."""
    import jax
    import jax.numpy as jnp
    times = []
    for r in range(repeats + 1):
        args = [jax.block_until_ready(jax.tree_util.tree_map(
            lambda a: jax.device_put(jnp.full(a.shape, 0.01, a.dtype), a.sharding), run[step][1]))
            for run in runs]
        c0 = time.process_time()
        jax.block_until_ready([run[step][0](*a) for run, a in zip(runs, args)])
        if r:
            times.append((time.process_time() - c0) / len(runs))
    return statistics.median(times)


def fit_stage(points, gemm: tuple[float, float], softmax: float, size: Size = FULL) -> tuple[float, float, float]:
    """(in-cache rate, effective cache bytes, spilled rate): bytes per CPU second of the rest of the
    elementwise work (norms, residuals, activations, RoPE) in the cost model's stage time fwd + bwd = 4 (GEMMs
    + softmax bytes / `softmax` + other bytes / rate) (`cfp.planner.costmodel`), the GEMMs at the fitted
    `gemm` curve (rate, half dimension). The rate is a step in the stage's working set (one micro-batch's
    layer activations, `ModelCost.layer_activation_bytes`): each split of the points by micro-batch gets a
    rate per side by least squares through the origin (the rate beyond lower than the one before, else the
    split is no cache); the split with the least relative squared error wins, its cache the midpoint of the
    working sets either side (no split: twice the largest point's)."""
    from cfp.costs import ModelCost
    m = ModelCost(stage_config(size))
    rate, half = gemm
    x, y, ws = [], [], []
    for mb, t in points:
        dots = sum(f / (rate * np.prod([d / (d + half) for d in mnk])) for f, mnk in m.layer_gemms(1, mb))
        x.append(4 * mb * (m.layer_elementwise_bytes(1) - m.layer_score_bytes(1)))
        y.append(t - 4 * (dots + mb * m.layer_score_bytes(1) / softmax))
        ws.append(mb * m.layer_activation_bytes(1))
    x, y = np.array(x), np.array(y)
    fit = lambda a, b: float(a @ a / (a @ b))                   # bytes per second: x = rate * y
    err = lambda a, b, r: float(np.sum((b - a / r) ** 2 / b ** 2))
    best = None
    # points[:cut] in cache, the rest spilled (two or more on each side), or all in cache
    for cut in (*range(2, len(points) - 1), len(points)):
        r_in = fit(x[:cut], y[:cut])
        r_out = fit(x[cut:], y[cut:]) if cut < len(points) else r_in
        if cut < len(points) and not r_out < r_in:
            continue                                            # not a cache: the rate must drop beyond it
        e = err(x[:cut], y[:cut], r_in) + (err(x[cut:], y[cut:], r_out) if cut < len(points) else 0.0)
        cache = (ws[cut - 1] + ws[cut]) / 2 if cut < len(points) else 2 * ws[-1]
        if best is None or e < best[0]:
            best = (e, r_in, cache, r_out)
    return best[1:]


def host_cores() -> int:
    """The cores this process may use (`os.sched_getaffinity`; the CPU count where the platform has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def measure(size: Size = QUICK, log: Optional[Callable[[str], None]] = None) -> CpuCalibration:
    """Measure this host's devices at `size` and fit the figures (`log`: each measured and fitted figure, said
    so). ValueError when a fitted figure is not positive and finite (a noisy host: the caller falls back)."""
    import jax
    say = log or (lambda s: None)
    cores, devices = host_cores(), len(jax.devices())
    points = gemm_points(size)
    rate, half = fit_gemm(points)
    say(f"GEMM fit: {rate / 1e9:.1f} GFLOP per CPU second at large shapes, half dimension {half:.1f} (fitted on "
        f"{len(points)} measured shapes)")
    soft = softmax_rate(size.repeats)
    stage = stage_points(size, cores)
    for mb, t in stage:
        say(f"Llama-2 {size.stage[0]} middle stage of 1 layer, forward + backward, {mb} sequences, {cores} at "
            f"once: {t * 1e3:.2f} ms CPU each (measured)")
    mem, cache, spilled = fit_stage(stage, (rate, half), soft, size)
    say(f"stage fit: other elementwise work {mem / 1e9:.2f} GB per CPU second while a stage's activations fit "
        f"{cache / 2 ** 20:.1f} MiB, {spilled / 1e9:.2f} beyond; softmax {soft / 1e9:.2f} (fitted, measured)")
    lat, link = fit_link(all_reduce_points(size, cores))
    say(f"all-reduce fit: latency {lat * 1e6:.0f} us, {link / 1e9:.2f} GB/s per device, all busy (fitted)")
    return calibration(cores=cores, devices=devices, rate=rate, half=half, mem=mem, cache=cache, spilled=spilled,
                       soft=soft, link=link, lat=lat)


def calibration(*, cores: int, devices: int, rate: float, half: float, mem: float, cache: float, spilled: float,
                soft: float, link: float, lat: float) -> CpuCalibration:
    """The `CpuCalibration` of fitted figures (per CPU second, bytes); ValueError naming any not positive."""
    figures = dict(cores=cores, devices=devices, gemm_gflops_per_core=round(rate / 1e9, 2),
                   gemm_half_dim=half, mem_gbps_per_core=round(mem / 1e9, 2),
                   cache_mib=round(cache / 2 ** 20, 1), spilled_mem_gbps_per_core=round(spilled / 1e9, 2),
                   softmax_gbps_per_core=round(soft / 1e9, 2),
                   link_gbps_per_core=round(link / 1e9 * devices / cores, 3),
                   collective_cpu_us=round(lat * 1e6 * cores / devices, 1),
                   host_memory_gb=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1))
    bad = [k for k, v in figures.items() if not (isinstance(v, (int, float)) and 0 < v < float("inf"))]
    if bad:
        # a stage time below what its GEMMs and softmax alone take leaves no time for the rest, and a
        # collective's fixed cost below the noise of few repeats fits to 0: measured in different states of
        # the host, or too few times
        raise ValueError(f"fitted {', '.join(f'{k}={figures[k]!r}' for k in bad)} must be positive")
    return CpuCalibration(**figures)
