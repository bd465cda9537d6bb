"""A searched stage plan against the stage's Megatron sharding, side by side.

Under the `measure` profiler both are timed as they run: the stage's runtime programs (fwd and bwd of each
of the pipeline's micro-batches, then the update) of a `StageProgram` cut from the searched choice and of the
Megatron `StageProgram`, in turns after a warm-up of each, so both see the same machine state. (The whole step
the search verified runs the forward once; the runtime runs it twice, once more inside bwd, so plans whose
forward is dear rank differently there.) Under `estimate` both whole steps are priced by the same GPU cost
model from their compiled figures. Each side adds the boundary transfer its activation layouts imply, and
the Megatron sharding runs only when it is faster.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax

from cfp.profiling import gpu_estimate
from cfp.profiling.options import ProfilerKind
from cfp.runtime.stage.boundary import boundary_seconds, replicated
from cfp.runtime.stage.replay import stage_step
from cfp.search.options import SearchOptions
from cfp.xla.compiled import compiled_figures, time_in_turns


@dataclasses.dataclass(frozen=True)
class MegatronComparison:
    searched_time: float        # seconds per micro-batch step
    megatron_time: float        # inf when the Megatron step is over the memory budget
    searched_boundary: float
    megatron_boundary: float
    megatron_memory: int        # compiled whole step; 0 when not compiled (measured, no budget)
    noise: Optional[float]      # relative noise of the measured times (None: estimated)
    same_sharding: bool = False  # the searched plan places parameters, state and activations as Megatron does

    @property
    def megatron_wins(self) -> bool:
        return self.megatron_time + self.megatron_boundary < self.searched_time + self.searched_boundary

    def text(self) -> str:
        if self.same_sharding:
            return "side by side: the searched plan is the Megatron sharding (same sharding, no comparison)"
        kind = "estimated" if self.noise is None else f"measured, noise ±{self.noise * 100:.1f}%"
        meg = ("over the memory budget" if self.megatron_time == float("inf")
               else f"{self.megatron_time * 1e3:.3f} ms")
        return (f"side by side ({kind}): searched {self.searched_time * 1e3:.3f} ms, Megatron {meg} "
                f"(+ boundary estimated {self.searched_boundary * 1e3:.3f} / {self.megatron_boundary * 1e3:.3f} "
                f"ms): {'Megatron' if self.megatron_wins else 'searched plan'} runs")


def compare_with_megatron(case, step, result, picked, planned: Callable[[], Any], sopts: SearchOptions,
                          profiler) -> Optional[MegatronComparison]:
    """Time (or estimate) `picked` (the chosen verified choice of search `result` on analysed `step`, a
    `cfp.runtime.stage.plan_search.Picked`) and the Megatron stage `case.prog` side by side; `planned()` gives the
    stage program of the picked choice (what the runtime would run, kept in the compile cache). None when the
    search verified nothing whole (`sopts.verify` 0); `sopts.iters` and `warmup` time the measured side by side,
    `sopts.memory_per_device` is the budget the Megatron step must fit."""
    if sopts.verify == 0:
        return None
    prog, args, analysis = case.prog, step.args, step.analysis
    budget = sopts.memory_per_device
    estimate = profiler.kind is ProfilerKind.ESTIMATE
    # the Megatron whole step is compiled for the cost model and for the memory budget only
    megatron = _megatron_step(prog, args) if estimate or budget is not None else None
    mem = compiled_figures(megatron, analysis.mesh.shape, collectives=False).memory if megatron else 0
    fits = budget is None or mem <= budget
    plan = planned()
    same = _same_stage_sharding(plan, prog, case)
    if estimate:
        searched = result.steps[picked.plan_choice].compile(*args)
        t_s, t_m = (_estimated(c, analysis, picked.verified.choice, profiler.gpu) for c in (searched, megatron))
        noise = None
    elif same:      # timing a sharding against itself measures nothing but noise
        t_s = t_m = 0.0
        noise = None
    else:
        (t_s, t_m), noise = _alternating([_runtime_run(p, args, case) for p in (plan, prog)],
                                         sopts.iters, sopts.warmup)
    megatron_boundary = boundary_seconds(case, *replicated(case), result.link_gbps)
    return MegatronComparison(t_s, t_m if fits else float("inf"), picked.boundary, megatron_boundary, mem, noise,
                              same)


def _same_stage_sharding(a, b, case) -> bool:
    """Whether stage programs `a` and `b` place parameters, optimizer state and the activations they take and
    hand on alike (equivalent shardings leaf by leaf)."""
    def leaves(p):
        x = p.act_in_shardings(case.x_like) if case.x_like is not None else None
        g = p.act_out_shardings(case.y_like) if case.y_like is not None else None
        return jax.tree_util.tree_leaves((p.shardings, p.opt_shardings, x, g))
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(
        x.is_equivalent_to(y, max(len(x.spec), len(y.spec))) for x, y in zip(la, lb))


def _megatron_step(prog, args):
    """The stage step compiled with the rules table's layouts (activations replicated)."""
    in_sh = (prog.shardings, prog.opt_shardings, prog.grad_shardings) + (prog.repl,) * (len(args) - 3)
    out_sh = (prog.shardings, prog.opt_shardings, prog.grad_shardings, prog.repl, prog.repl)
    return jax.jit(stage_step(prog), in_shardings=in_sh, out_shardings=out_sh).lower(*args).compile()


def _runtime_run(p, args, case) -> tuple[Callable[[], Any], int]:
    """A function running stage program `p` as one pipeline step runs it on the example micro-batch: fwd and bwd
    of the pipeline's micro-batches, then the update; returns what to wait for. Seconds are per micro-batch."""
    params, opt, _, x, batch, g_y, scale, globals_ = args
    state = {"params": p.place_params(params), "opt": p.place_opt_state(opt), "acc": p.zeros()}
    x = None if x is None else jax.device_put(x, p.act_in_shardings(case.x_like))
    batch = None if batch is None else jax.device_put(batch, p.batch_shardings(case.batch_like))
    g_y = None if g_y is None else jax.device_put(g_y, p.act_out_shardings(case.y_like))

    def run():
        outs = []
        for _ in range(case.chunks):
            out, kept = p.forward(state["params"], x, batch)
            outs.append(out)
            state["acc"] = p.backward(state["params"], kept, batch, g_y, state["acc"])[0]
        parts = [dict(state["acc"], layers=[state["acc"]["layers"]])]
        state["params"], state["opt"], flags = p.update(state["params"], state["opt"], parts, scale, globals_)
        state["acc"] = p.zeros()
        return outs, flags, state["params"]
    return run, case.chunks


def _estimated(compiled, analysis, choice, gpu_name: str) -> float:
    from cfp.hardware.gpus import get_gpu
    gpu = get_gpu(gpu_name)
    shape = analysis.mesh.shape
    fig = compiled_figures(compiled, shape, collectives=True)
    dtype = gpu_estimate.dominant_dtype(analysis, range(len(analysis.blocks)))
    # the dots of both are the stage's same dots; their rate is taken at the searched choice's shapes
    return gpu_estimate.estimated_time(fig, shape, gpu, dtype, gpu_estimate.dots_rate(analysis, enumerate(choice), gpu))


def _alternating(runs: list[tuple[Callable[[], Any], int]], iters: int, warmup: int) -> tuple[list[float], float]:
    """Median seconds (per unit of work: each run's second item) of each run, timed in turns; and the largest
    relative noise (half range over median) among them."""
    timed = time_in_turns([lambda fn=fn: fn for fn, _ in runs], iters, warmup)
    meds = [med / units for (med, _), (_, units) in zip(timed, runs)]
    return meds, max(noise for _, noise in timed)
