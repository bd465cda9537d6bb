"""Building a scheme space: measured on this machine's devices, or estimated for a GPU type.

Measured: for each <CP,TP,PP> asked for (by default those the devices and the model's heads allow with
tp <= 2, and pp 2 for the smallest), one pipeline of the training engine runs a micro-batch of a single
sequence of length s (median of `repeats` runs, forward+backward through its pp stages) for several s; the
time per stage (pipeline time / pp) and the per-device memory of the largest stage (XLA's memory analysis:
arguments + outputs + temporaries) get least-squares fits a·s²+b·s+c, and max_len is the largest bucket
length (a power of two) whose fitted memory is within the budget.

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

import itertools
import math
import time
from typing import Sequence

import numpy as np

from cfp.data.schemes import Scheme, SchemeSpace, fit_quadratic
from cfp.errors import ConfigError

DEFAULT_MFU = 0.5
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


def measure_space(model: str, config_name: str, cfg, params, memory_mb: float,
                  lengths: Sequence[int] = (256, 512, 1024), repeats: int = 3,
                  num_devices: int | None = None, log=None,
                  shapes: Sequence[tuple[int, int, int]] | None = None) -> SchemeSpace:
    """Fits from timed runs of the training engine on this machine's devices: per (cp, tp, pp) in `shapes`
    (default `default_shapes`), one pipeline of pp stages runs a packed micro-batch of one sequence."""
    import jax

    n = num_devices or jax.device_count()
    lengths = [s for s in lengths if s <= cfg.seq_len]
    if len(lengths) < 3:   # a short model: its own lengths (the fit needs three)
        lengths = [cfg.seq_len // 4, cfg.seq_len // 2, cfg.seq_len]
    out = []
    for shape in (default_shapes(cfg, n) if shapes is None else shapes):
        if shape[0] * shape[1] * shape[2] > n:
            raise ConfigError(f"scheme (cp, tp, pp) {shape} needs {shape[0] * shape[1] * shape[2]} devices, "
                              f"only {n} are available")
        scheme = _measure_scheme(model, cfg, params, shape, lengths, repeats, memory_mb)
        if scheme is None:
            continue
        out.append(scheme)
        if log:
            log(f"  measured {scheme.name}: time {scheme.a:.3g}·s² + {scheme.b:.3g}·s + {scheme.c:.3g} s per "
                f"stage and micro-batch, max_len {scheme.max_len}")
    if not out:
        raise ConfigError(f"no scheme fits {memory_mb} MiB per device; raise --memory-mb")
    return SchemeSpace(model, config_name, f"measured: {jax.devices()[0].platform} x{n}, memory budget "
                       f"{memory_mb} MiB/device", tuple(out))


def _measure_scheme(model: str, cfg, params, shape, lengths, repeats: int, memory_mb: float) -> Scheme | None:
    """One scheme's fits: time per stage = the pipeline's time on one micro-batch / pp (a micro-batch passes
    the pp stages one after another), memory = the largest stage's backward program (XLA's memory analysis:
    arguments + outputs + temporaries); None if no length fits the budget."""
    import jax

    from cfp.data.batching import materialize
    from cfp.layout import Layout
    from cfp.models.layered import zoo_params
    from cfp.runtime.engine import zoo_trainer
    cp, tp, pp = shape
    trainer = zoo_trainer(model, cfg, Layout.from_schemes([shape], cfg.num_layers))
    layered = zoo_params(params, cfg.num_layers)
    trainer.load_state(layered, trainer.tx.init(layered), 0)
    rng = np.random.default_rng(0)
    times, mems = [], []
    for s in lengths:
        mb = [[materialize([rng.integers(0, 256, s + 1).astype(np.uint8)], [0], packed=True)]]
        stage_mem = trainer.stage_memory(jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), mb[0][0]))
        mems.append(max(stage_mem))
        trainer.forward_backward(mb)  # warm
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(trainer.forward_backward(mb))
            ts.append(time.perf_counter() - t0)
        times.append(float(np.median(ts)) / pp)
    a, b, c = fit_quadratic(lengths, times)
    ma_, mb_, mc_ = fit_quadratic(lengths, mems)
    budget = memory_mb * 2 ** 20
    cands = [x for x in (1 << i for i in range(7, 20)) if x <= cfg.seq_len
             and ma_ * x * x + mb_ * x + mc_ <= budget]
    if not cands:
        return None
    return Scheme(cp, tp, pp, a, b, c, max(cands), dense_rows=True)
