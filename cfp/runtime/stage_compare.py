"""A searched stage plan against the stage's Megatron sharding, side by side.

Both run the same `stage_step` on the same example micro-batch: the searched choice as the search compiled it
(`ShardedStep`, every block constrained), the Megatron sharding as the runtime's Megatron stage does (the rules
table's parameter layouts, activations replicated, GSPMD propagating the rest). Under the `measure` profiler
the two compiled steps are timed alternately after a warm-up of each, so both see the same machine state;
under `estimate` both are priced by the same GPU cost model from their compiled figures. Each side adds the
boundary transfer its activation layouts imply. The Megatron sharding runs only when it is faster.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Optional

import jax

from cfp.profiling import costmodel
from cfp.profiling.options import ProfilerKind
from cfp.runtime.stage_replay import stage_step
from cfp.xla.compiled import compiled_figures


@dataclasses.dataclass(frozen=True)
class MegatronComparison:
    searched_time: float        # seconds per micro-batch step
    megatron_time: float        # inf when the Megatron step is over the memory budget
    searched_boundary: float
    megatron_boundary: float
    megatron_memory: int
    noise: Optional[float]      # relative noise of the measured times (None: estimated)

    @property
    def megatron_wins(self) -> bool:
        return self.megatron_time + self.megatron_boundary < self.searched_time + self.searched_boundary

    def text(self) -> str:
        kind = "estimated" if self.noise is None else f"measured, noise ±{self.noise * 100:.1f}%"
        meg = ("over the memory budget" if self.megatron_time == float("inf")
               else f"{self.megatron_time * 1e3:.3f} ms")
        return (f"side by side ({kind}): searched {self.searched_time * 1e3:.3f} ms, Megatron {meg} "
                f"(+ boundary estimated {self.searched_boundary * 1e3:.3f} / {self.megatron_boundary * 1e3:.3f} "
                f"ms): {'Megatron' if self.megatron_wins else 'searched plan'} runs")


def compare_with_megatron(prog, tx, args, analysis, result, chosen, boundary: float, megatron_boundary: float,
                          options, profiler) -> Optional[MegatronComparison]:
    """Time (or estimate) `chosen` (a verified choice of `result`) and the Megatron stage step side by side;
    None when the search verified nothing whole (`verify` 0)."""
    sopts = options.search_options()
    if sopts.verify == 0:
        return None
    step = result.steps[(tuple(chosen.choice), tuple(chosen.shard_state))]
    searched = step.compile(*args)
    searched_args = jax.tree_util.tree_leaves(step.shard_args(*args))
    in_sh = (prog.shardings, prog.opt_shardings, prog.grad_shardings) + (prog.repl,) * (len(args) - 3)
    n_rest = len(jax.tree_util.tree_structure(jax.eval_shape(stage_step(prog, tx), *args)).children()) - 3
    out_sh = (prog.shardings, prog.opt_shardings, prog.grad_shardings) + (prog.repl,) * n_rest
    fn = jax.jit(stage_step(prog, tx), in_shardings=in_sh, out_shardings=out_sh)
    megatron = fn.lower(*args).compile()
    mem = compiled_figures(megatron, analysis.mesh.shape, collectives=False).memory
    budget = sopts.memory_per_device
    fits = budget is None or mem <= budget
    if profiler.kind is ProfilerKind.ESTIMATE:
        t_s, t_m = (_estimated(c, analysis, chosen.choice, profiler.gpu) for c in (searched, megatron))
        noise = None
    else:
        meg_args = jax.device_put(args, in_sh)
        (t_s, t_m), noise = _alternating([(searched, searched_args), (megatron, meg_args)], sopts.iters,
                                         sopts.warmup)
    return MegatronComparison(t_s, t_m if fits else float("inf"), boundary, megatron_boundary, mem, noise)


def _estimated(compiled, analysis, choice, gpu_name: str) -> float:
    from cfp.hardware.gpus import get_gpu
    gpu = get_gpu(gpu_name)
    shape = analysis.mesh.shape
    fig = compiled_figures(compiled, shape, collectives=True)
    dtype = costmodel.dominant_dtype(analysis, range(len(analysis.blocks)))
    # the dots of both are the stage's same dots; their rate is taken at the searched choice's shapes
    return costmodel.estimated_time(fig, shape, gpu, dtype, costmodel.dots_rate(analysis, enumerate(choice), gpu))


def _alternating(runs: list[tuple[Any, Any]], iters: int, warmup: int) -> tuple[list[float], float]:
    """Median seconds of each compiled program, timed in turns; and the largest relative noise (half range
    over median) among them."""
    for _ in range(warmup):
        for fn, a in runs:
            jax.block_until_ready(fn(*a))
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(iters):
        for (fn, a), ts in zip(runs, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
    meds = [statistics.median(ts) for ts in times]
    noise = max((max(ts) - min(ts)) / 2 / m for ts, m in zip(times, meds) if m > 0)
    return meds, noise
