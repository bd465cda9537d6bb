"""Building a scheme space: measured on this machine's devices, or estimated for a GPU type.

Measured (cost form ROWS, `cfp.data.schemes`): for each <CP,TP,PP> asked for (by default those the devices
and the model's heads allow with tp <= 2, and pp 2 for the smallest), one pipeline of the training engine is
built; max_len is the widest power-of-two row whose largest stage's backward program (XLA's memory analysis:
arguments + outputs + temporaries, per device) fits the memory budget (a micro-batch of R rows of width W <=
max_len / R needs no more: the same tokens in shorter rows hold fewer attention scores). Then micro-batches of
the shapes [R, W] the data path runs -- one row of 128 and of each of the three widest widths, and max_len /
128 rows of 128 -- are timed (median of `repeats` runs of forward+backward under 1F1B) and
a·E + b·R·W + c (E the score entries the attention computes, `cfp.data.rows.layout_entries`) is fitted to the time per stage, least squares in relative error. A pipeline of pp > 1
stages runs 4 micro-batches at once and its time is divided by 4 + pp - 1: the stage time the estimate
Σ cost + (pp-1)·max cost needs, with whatever stages that share the host's cores lose to each other. Last, how
many pipelines the devices run side by side at full speed (`SchemeSpace.parallel_pipelines`): two pipelines of
the smallest scheme at once against one alone, 2·t_one / t_two (simulated CPU devices share the host's cores).

Estimated (GPU cost model, bf16, flash-style varlen attention): per stage and micro-batch of s tokens
    flops  = 3·F_token·s·L/pp + 6·h·s²·L/pp  (causal attention: half of 12·h·s² per layer)  [+ the head on the
             last stage, 3·F_head·s/pp spread]
with F_token a layer's forward dot FLOPs per token and F_head the head's, and the parameter counts of
`cfp.costs.ModelCost` (the figures every pricing pass reads)
    time   = flops / (cp·tp · peak_bf16 · MFU) + TP all-reduces 4·2(tp-1)/tp·s·h·2 B·L/pp / link
             + CP ring 2·2·(cp-1)/cp·s·kv·2 B·L/pp / link  (not overlapped: pessimistic)
    memory = 16 B·params/(tp·pp) + 34·h·s·L/(tp·cp) B  (1F1B keeps ~pp micro-batches on stage 0, each
             L/pp layers; Korthikanti et al. 2022 activations without the s² term thanks to flash attention)
The MFU factor (default 0.5) and these formulas are estimates; figures from them are labelled estimated.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from typing import Sequence

import numpy as np

from cfp.data.rows import MIN_WIDTH, arrange, layout_entries
from cfp.data.schemes import CostForm, Scheme, SchemeSpace, fit_nonnegative, fit_quadratic
from cfp.errors import ConfigError
from cfp.schedules.registry import ScheduleName

DEFAULT_MFU = 0.5
PIPELINED = 4       # micro-batches in flight when timing a pipeline of pp > 1 stages
MEMORY_HEADROOM = 0.9   # fraction of GPU memory a plan may use (allocator fragmentation, buffers)


def get_gpu(name: str):
    """The GPU catalog lookup (the one place that names its module)."""
    from cfp.hardware.gpus import get_gpu as _get
    return _get(name)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def estimate_space(model: str, config_name: str, cfg, gpu_name: str, max_devices: int = 64,
                   mfu: float = DEFAULT_MFU, lengths: Sequence[int] = (1024, 4096, 16384, 65536)) -> SchemeSpace:
    gpu = get_gpu(gpu_name)
    if not 0 < mfu <= 1:
        raise ConfigError(f"mfu={mfu!r} must be in (0, 1]")
    h, L = cfg.hidden_size, cfg.num_layers
    kv = getattr(cfg, "num_kv_heads", cfg.num_heads) * cfg.head_dim
    link = gpu.link_gbps * 1e9
    peak = gpu.peak_flops("bfloat16") * mfu
    from cfp.costs import ModelCost
    cost = ModelCost(cfg)
    p_total = cost.layer_params(1) * L + cost.embed_params(1) + cost.head_params(1)
    token_flops, head_flops = cost.layer_token_flops(1), cost.head_dot_flops(1) / cfg.seq_len
    pw2 = [1 << i for i in range(int(math.log2(max_devices)) + 1)]
    out = []
    for cp, tp, pp in itertools.product(pw2, pw2, pw2):
        if cp * tp * pp > max_devices or cfg.num_heads % tp or L % pp or tp > 8:
            continue
        lpp = L / pp
        s = np.asarray(lengths, np.float64)
        flops = 3 * token_flops * s * lpp + 6 * h * s * s * lpp + 3 * head_flops * s / pp
        t = flops / (cp * tp * peak)
        t += (4 * 2 * (tp - 1) / tp * s * h * 2 * lpp + 4 * (cp - 1) / cp * s * kv * 2 * lpp) / link
        a, b, c = fit_quadratic(s, t + 20e-6 * lpp)   # ~20 µs of launches per layer and micro-batch
        states = 16 * p_total / (tp * pp)
        per_token = 34 * h * L / (tp * cp)
        room = gpu.mem_gb * 1e9 * MEMORY_HEADROOM - states
        if room <= per_token * 128:
            continue
        max_len = int(room // per_token) // 128 * 128
        out.append(Scheme(cp, tp, pp, a, b, c, max_len))
    if not out:
        raise ConfigError(f"no <CP,TP,PP> scheme of {model} {config_name} fits {gpu.name} memory within "
                          f"{max_devices} devices")
    return SchemeSpace(model, config_name, f"estimated: cost model on {gpu.name} (bf16 peak x MFU {mfu})",
                       tuple(out))


def default_shapes(cfg, n: int) -> list[tuple[int, int, int]]:
    """(cp, tp, pp) measured by default on n devices: tp <= 2 (keeps the CPU measurement short), cp x tp a
    power of two, pp 1 -- and pp 2 for cp x tp <= 2 where the layers split in two."""
    kv = getattr(cfg, "num_kv_heads", cfg.num_heads)
    out = []
    for pp in (1, 2):
        for cp in _divisors(n):
            for tp in _divisors(n // cp):
                if cfg.num_heads % tp or kv % tp or tp > 2 or cp * tp not in (1, 2, 4, 8):
                    continue
                if pp == 1 or (cp * tp <= 2 and cp * tp * pp <= n and cfg.num_layers % pp == 0):
                    out.append((cp, tp, pp))
    return out


def measure_space(model: str, config_name: str, cfg, params, memory_mb: float, *,
                  repeats: int = 3, num_devices: int | None = None, log=None,
                  shapes: Sequence[tuple[int, int, int]] | None = None, parallelism: bool = True) -> SchemeSpace:
    """Fits from timed runs of the training engine on this machine's devices: per (cp, tp, pp) in `shapes`
    (default `default_shapes`), one pipeline of pp stages runs packed micro-batches of several row shapes;
    with `parallelism`, also `measure_parallelism` on the smallest scheme."""
    import jax

    n = num_devices or jax.device_count()
    out = []
    for shape in (default_shapes(cfg, n) if shapes is None else shapes):
        if shape[0] * shape[1] * shape[2] > n:
            raise ConfigError(f"scheme (cp, tp, pp) {shape} needs {shape[0] * shape[1] * shape[2]} devices, "
                              f"only {n} are available")
        scheme = _measure_scheme(model, cfg, params, shape, repeats, memory_mb)
        if scheme is None:
            continue
        out.append(scheme)
        if log:
            log(f"  measured {scheme.name}: time {scheme.a:.3g}·E + {scheme.b:.3g}·R·W + {scheme.c:.3g} s "
                f"per stage and micro-batch [R, W] (E: its attention score entries), max_len {scheme.max_len}")
    if not out:
        raise ConfigError(f"no scheme fits {memory_mb} MiB per device; raise --memory-mb")
    small = min(out, key=lambda s: (s.devices, s.pp))
    parallel = (measure_parallelism(model, cfg, params, (small.cp, small.tp, small.pp), small.max_len, repeats)
                if parallelism and 2 * small.devices <= n else None)
    if log and parallel is not None:
        log(f"  measured: {parallel:.2f} pipelines run side by side at the speed of one alone")
    return SchemeSpace(model, config_name, f"measured: {jax.devices()[0].platform} x{n}, memory budget "
                       f"{memory_mb} MiB/device", tuple(out), parallel, cfg.seq_len)


def reused_or_measured(path: str, model: str, config_name: str, cfg, params, memory_mb: float, *,
                       shapes: Sequence[tuple[int, int, int]] = (), only_shapes: bool = False,
                       log=print) -> SchemeSpace:
    """The scheme space saved at `path` where it was measured here for this model, config and row limit
    (`SchemeSpace.reusable_for`, rows up to ``cfg.seq_len``), else measured anew (only `shapes` with
    `only_shapes`, else every default scheme); the `shapes` it lacks are measured and added. Written back to
    `path` whenever measured."""
    space = None
    try:
        space = SchemeSpace.load(path) if os.path.exists(path) else None
    except ConfigError as e:
        log(f"not reusing {path}: {e}")
    if space is not None and not space.reusable_for(model, config_name, cfg.seq_len):
        space = None
    changed = space is None
    if space is None:
        log(f"measuring the scheme space on this machine (written to {path} for reuse) ...")
        space = measure_space(model, config_name, cfg, params, memory_mb, log=log,
                              shapes=list(shapes) if only_shapes else None)
    missing = [s for s in shapes if s not in {x.shape for x in space.schemes}]
    if missing:
        log(f"measuring schemes {missing} on this machine (added to {path}) ...")
        more = measure_space(model, config_name, cfg, params, memory_mb, log=log, shapes=missing,
                             parallelism=False)
        space, changed = dataclasses.replace(space, schemes=space.schemes + more.schemes), True
    if changed:
        space.save(path)
    else:
        log(f"scheme space from {path} ({space.source})")
    return space


def measure_parallelism(model: str, cfg, params, shape, width: int, repeats: int = 3) -> float:
    """2·t_one / t_two in [1, 2]: t_one the time of one pipeline of `shape` on a micro-batch of one row of
    `width`, t_two that of two such pipelines side by side (each its own devices and micro-batch); the two
    timed in turns (median of `repeats` each)."""
    import jax

    from cfp.layout import Layout
    from cfp.models.layered import zoo_model, zoo_params
    from cfp.runtime.engine import HeteroTrainer, adamw
    from cfp.runtime.stage.cache import CompileCache
    cache = CompileCache(zoo_model(model, cfg, 0, abstract=True), adamw(1e-3, 0.01))
    layered = zoo_params(params, cfg.num_layers)
    trainers = []
    for k in (1, 2):
        tr = HeteroTrainer(cache.model, None, Layout.from_schemes([shape] * k, cfg.num_layers),
                           ScheduleName.ONE_F_ONE_B, cache=cache)
        tr.load_state(layered, tr.tx.init(layered), 0)
        trainers.append(tr)
    rng = np.random.default_rng(1)
    batches = [[[_row_batch(rng, 1, width)] for _ in range(k)] for k in (1, 2)]
    for tr, mb in zip(trainers, batches):
        tr.forward_backward(mb)   # warm: compiles
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for k, (tr, mb) in enumerate(zip(trainers, batches)):
            t0 = time.perf_counter()
            jax.block_until_ready(tr.forward_backward(mb))
            times[k].append(time.perf_counter() - t0)
    return float(np.clip(2 * np.median(times[0]) / np.median(times[1]), 1.0, 2.0))


def timed_shapes(max_len: int) -> list[tuple[int, int]]:
    """The micro-batch shapes [R, W] a scheme's time is fitted to: one row of 128 (it holds the constant c)
    and of each of the three widest power-of-two widths up to max_len, and max_len / 128 rows of 128."""
    ones = [(1, w) for w in (MIN_WIDTH << k for k in range(20)) if w <= max_len]
    return list(dict.fromkeys(ones[:1] + ones[-3:] + [(max_len // MIN_WIDTH, MIN_WIDTH)]))


def _row_batch(rng, num_rows: int, width: int) -> dict:
    """A packed micro-batch [num_rows, width]: each row one sequence filling it."""
    from cfp.data.batching import materialize
    seqs = [rng.integers(0, 256, width + 1).astype(np.uint8) for _ in range(num_rows)]
    return materialize(seqs, list(range(num_rows)), packed=True)


def _max_len(trainer, cfg, memory_mb: float) -> int | None:
    """The widest power-of-two row (<= the model's seq_len) whose largest stage fits the budget."""
    import jax
    best = None
    for w in (MIN_WIDTH << k for k in range(20)):
        like = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                      _row_batch(np.random.default_rng(0), 1, w))
        if w > cfg.seq_len or max(trainer.stage_memory(like)) > memory_mb * 2 ** 20:
            break
        best = w
    return best


def _measure_scheme(model: str, cfg, params, shape, repeats: int, memory_mb: float) -> Scheme | None:
    """One scheme: max_len from the compiled memory (`_max_len`), time per stage fitted over `timed_shapes`:
    the pipeline's time on m micro-batches of the shape (1F1B; m = 1 for pp = 1, else `PIPELINED`) / (m + pp
    - 1), so the fit holds what stages that share devices' cores lose to each other in a step, as the
    estimate Σ cost + (pp - 1) max cost counts it; None if no row fits the budget."""
    import jax

    from cfp.layout import Layout
    from cfp.models.layered import zoo_params
    from cfp.runtime.engine import zoo_trainer
    cp, tp, pp = shape
    trainer = zoo_trainer(model, cfg, Layout.from_schemes([shape], cfg.num_layers), ScheduleName.ONE_F_ONE_B)
    layered = zoo_params(params, cfg.num_layers)
    trainer.load_state(layered, trainer.tx.init(layered), 0)
    max_len = _max_len(trainer, cfg, memory_mb)
    if max_len is None:
        return None
    rng = np.random.default_rng(0)
    rows, times = [], []
    in_flight = 1 if pp == 1 else PIPELINED
    for r, w in timed_shapes(max_len):
        mb = [[_row_batch(rng, r, w)] * in_flight]
        trainer.forward_backward(mb)  # warm: compiles
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(trainer.forward_backward(mb))
            ts.append(time.perf_counter() - t0)
        # m micro-batches through pp stages take (m + pp - 1) stage-times where the stages run side by side
        times.append(float(np.median(ts)) / (in_flight + pp - 1))
        rows.append([layout_entries(arrange([w] * r, packed=True), [w] * r, cp > 1)[0], r * w, 1.0])
    if len(times) < 3:   # one shape only (max_len 128): its time is the cost of every micro-batch
        return Scheme(cp, tp, pp, 0.0, 0.0, times[0], max_len, CostForm.ROWS)
    t = np.asarray(times)
    a, b, c = fit_nonnegative(np.asarray(rows) / t[:, None], np.ones_like(t))
    return Scheme(cp, tp, pp, a, b, c, max_len, CostForm.ROWS)
