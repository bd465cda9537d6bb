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
from jax.sharding import PartitionSpec as P

from cfp.profiling import costmodel
from cfp.profiling.options import ProfilerKind
from cfp.runtime.stage.boundary import boundary_seconds
from cfp.runtime.stage.replay import stage_step
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


def compare_with_megatron(case, tx, step, result, picked, planned: Callable[[], Any], options,
                          profiler) -> Optional[MegatronComparison]:
    """Time (or estimate) `picked` (the chosen verified choice of search `result` on analysed `step`, a
    `cfp.runtime.stage.search.Picked`) and the Megatron stage `case.prog` side by side; `planned()` gives the
    stage program of the picked choice (what the runtime would run, kept in the compile cache). None when the
    search verified nothing whole (`verify` 0)."""
    sopts = options.search_options()
    if sopts.verify == 0:
        return None
    prog, args, analysis = case.prog, step.args, step.analysis
    budget = sopts.memory_per_device
    estimate = profiler.kind is ProfilerKind.ESTIMATE
    # the Megatron whole step is compiled for the cost model and for the memory budget only
    megatron = _megatron_step(prog, tx, args) if estimate or budget is not None else None
    mem = compiled_figures(megatron, analysis.mesh.shape, collectives=False).memory if megatron else 0
    fits = budget is None or mem <= budget
    plan = planned()
    same = _same_stage_sharding(plan, prog)
    if estimate:
        searched = result.steps[picked.plan_choice].compile(*args)
        t_s, t_m = (_estimated(c, analysis, picked.verified.choice, profiler.gpu) for c in (searched, megatron))
        noise = None
    elif same:      # timing a sharding against itself measures nothing but noise
        t_s = t_m = 0.0
        noise = None
    else:
        (t_s, t_m), noise = _alternating([_runtime_run(p, args, case.chunks) for p in (plan, prog)],
                                         sopts.iters, sopts.warmup)
    megatron_boundary = boundary_seconds(case, P(), P(), result.link_gbps)
    return MegatronComparison(t_s, t_m if fits else float("inf"), picked.boundary, megatron_boundary, mem, noise,
                              same)


def _same_stage_sharding(a, b) -> bool:
    """Whether stage programs `a` and `b` place parameters, optimizer state and the activations they take and
    hand on alike (equivalent shardings leaf by leaf)."""
    def leaves(p):
        return jax.tree_util.tree_leaves((p.shardings, p.opt_shardings, p.act_in, p.act_out))
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(
        x.is_equivalent_to(y, max(len(x.spec), len(y.spec))) for x, y in zip(la, lb))


def _megatron_step(prog, tx, args):
    """The stage step compiled with the Megatron stage's layouts (activations replicated)."""
    in_sh = (prog.shardings, prog.opt_shardings, prog.grad_shardings) + (prog.repl,) * (len(args) - 3)
    n_rest = len(jax.tree_util.tree_structure(jax.eval_shape(stage_step(prog, tx), *args)).children()) - 3
    out_sh = (prog.shardings, prog.opt_shardings, prog.grad_shardings) + (prog.repl,) * n_rest
    return jax.jit(stage_step(prog, tx), in_shardings=in_sh, out_shardings=out_sh).lower(*args).compile()


def _runtime_run(p, args, chunks: int) -> Callable[[], Any]:
    """A function running stage program `p` as one pipeline step runs it on the example micro-batch: fwd and
    bwd of `chunks` micro-batches, then the update; returns what to wait for. Seconds are per micro-batch."""
    put = lambda v, s: jax.device_put(v, s)
    state = {"params": p.place_params(args[0]), "opt": put(args[1], p.opt_shardings), "acc": p.zeros()}
    x = put(args[3], p.act_in)
    if p.stage.is_last:
        fwd_args = (x,) + tuple(put(a, p.repl) for a in args[4:7])
        bwd_args = fwd_args + (put(args[7], p.repl),)
    else:
        fwd_args = (x,)
        bwd_args = (x, put(args[4], p.act_out), put(args[5], p.repl))

    def run():
        outs = []
        for _ in range(chunks):
            outs.append(p.fwd(state["params"], *fwd_args))
            r = p.bwd(state["params"], *bwd_args, state["acc"])
            state["acc"] = r[0]
        state["params"], state["opt"], flags = p.update(state["params"], state["opt"], [state["acc"]])
        return outs, flags, state["params"]
    return run, chunks


def _estimated(compiled, analysis, choice, gpu_name: str) -> float:
    from cfp.hardware.gpus import get_gpu
    gpu = get_gpu(gpu_name)
    shape = analysis.mesh.shape
    fig = compiled_figures(compiled, shape, collectives=True)
    dtype = costmodel.dominant_dtype(analysis, range(len(analysis.blocks)))
    # the dots of both are the stage's same dots; their rate is taken at the searched choice's shapes
    return costmodel.estimated_time(fig, shape, gpu, dtype, costmodel.dots_rate(analysis, enumerate(choice), gpu))


def _alternating(runs: list[tuple[Callable[[], Any], int]], iters: int, warmup: int) -> tuple[list[float], float]:
    """Median seconds (per unit of work: each run's second item) of each run, timed in turns; and the largest
    relative noise (half range over median) among them."""
    timed = time_in_turns([lambda fn=fn: fn for fn, _ in runs], iters, warmup)
    meds = [med / units for (med, _), (_, units) in zip(timed, runs)]
    return meds, max(noise for _, noise in timed)
