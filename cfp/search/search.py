"""The search pass: DP over segments on the profile table, then the best few whole plans compiled and timed."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from cfp.analysis.analysis import Analysis
from cfp.analysis.blocks import data_parallel_choice
from cfp.baselines.uniform import dp_tp_choice
from cfp.baselines.user_layouts import USER_LAYOUTS, Layout, ilp_shardings, user_layout_shardings
from cfp.errors import CfpError, ConfigError, InfeasibleError
from cfp.hardware import alpha_beta
from cfp.hardware.gpus import GpuSpec, get_gpu
from cfp.ir.capture import Program
from cfp.profiling import gpu_estimate
from cfp.profiling.options import ProfilerKind, ProfilerSpec
from cfp.profiling.table import ProfileTable
from cfp.search.dp import DPSolution, dp_search
from cfp.search.loop_figures import LoopBodies
from cfp.search.options import SearchOptions, fmt_bytes
from cfp.search.state_sharding import StateEstimator
from cfp.sharding.specs import StepShardings, donated_bytes
from cfp.sharding.step import ShardedStep, apply_choice
from cfp.xla.compiled import compiled_figures, compiled_memory, time_compiled, time_interleaved


@dataclasses.dataclass(frozen=True)
class VerifiedChoice:
    choice: tuple[int, ...]
    shard_state: tuple[int, ...]   # blocks whose parameters/optimizer state are stored sharded (ZeRO-3)
    dp_time: float            # the DP's sum of segment times plus resharding
    time: float               # whole-step seconds: measured, or the GPU cost model under `estimate`
    memory: int               # per-device bytes of the compiled whole step (arguments + outputs + temporaries)
    flops: float              # FLOPs of one step over all devices
    noise: float | None = None    # relative spread of the measured time (None: estimated, exact)
    comm_bytes: int = 0       # per-device bytes of the compiled step's collectives (a tie-break)
    remats: int = 0           # involuntary full rematerializations XLA reported compiling it
    layout: str = ""          # a `Layout` (a plain layout or the ILP's plan) rather than a searched choice
    label: str = "searched"   # what the candidate is, for people: "searched", "plain FSDP", ...

    @property
    def key(self) -> tuple:
        """Its step's key in `SearchResult.steps`: (choice, sharded-state blocks), and the layout if any."""
        return (self.choice, self.shard_state) + ((self.layout,) if self.layout else ())


@dataclasses.dataclass(frozen=True)
class SearchResult:
    choice: tuple[int, ...]
    shard_state: tuple[int, ...]
    best: VerifiedChoice
    verified: tuple[VerifiedChoice, ...]
    link_gbps: float
    budget: int | None
    search_time: float
    # the label of the plain layout (cfp's uniform data parallel or FSDP, or a layout users write, or the
    # Alpa-style ILP's plan) when it was faster than every searched plan and so was chosen
    baseline: str | None = None
    searched: VerifiedChoice | None = None     # then, the fastest searched plan that lost to it
    profiler: ProfilerSpec | None = None       # what timed the plans (None: measured)
    # `VerifiedChoice.key` -> compiled ShardedStep
    steps: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # the layouts users write and the ILP's plan, verified beside `verified` (whose choices they are not)
    layouts: tuple[VerifiedChoice, ...] = ()
    comm: Any = None          # the alpha-beta model that priced resharding (`cfp.hardware.alpha_beta`)

    @property
    def layout(self) -> str:
        """The `Layout` value of the chosen plan when it is not a searched choice, else ""."""
        return self.best.layout

    @property
    def time_label(self) -> str:
        """How the times were obtained: measured whole, or estimated (by a GPU cost model, or, with no
        whole-step verification, as the DP's sum of the segments' profiles and estimated resharding)."""
        if self.profiler is not None and self.profiler.kind is ProfilerKind.ESTIMATE:
            return f"estimated: {self.profiler.gpu} cost model"
        if self.best.noise is None:
            return "estimated: segment profiles summed by the DP, not timed whole"
        return "measured"

    def report(self, how: str | None = None, memory_how: str = "compiled on this host") -> str:
        """The result's lines; `how` labels the times (default: `time_label`, following the profiler)."""
        how = how or self.time_label
        b = self.best
        return "\n".join([
            f"searched ParallelBlock Strategies solution: {list(self.choice)}",
            *([f"sharded state (ZeRO-3) of blocks: {list(self.shard_state)}"] if self.shard_state else []),
            f"searched training cost (s per step, {how}): {[float(f'{v.time:.4g}') for v in self.verified]}",
            f"memory_cost ({memory_how}): {b.memory} ({fmt_bytes(b.memory)} per device"
            + (f", budget {fmt_bytes(self.budget)})" if self.budget else ")"),
            f"TFLOP_COUNT (compiled step, all devices, incl. LM head and attention): {b.flops / 1e12:.6g}",
            f"tflops ({how} time): "
            f"{[float(f'{v.flops / 1e12 / v.time:.4g}') if v.time > 0 else 0.0 for v in self.verified]}",
            self.margin_text(),
            *([self.baseline_text(how)] if self.baseline else []),
            *([f"resharding priced by an alpha-beta model: {alpha_beta.summary(self.comm)}"] if self.comm else []),
        ])

    def baseline_text(self, how: str | None = None) -> str:
        """Why the plain layout was chosen: the searched plans were slower than it, or tied with it within the
        measured noise (ties go to the least memory, see `_best_fitting`)."""
        how = how or self.time_label
        s, b = self.searched, self.best
        if s is None or s.time == float("inf"):
            return f"chosen plan is the {self.baseline} baseline: no searched plan fit the budget"
        lost = (f"the fastest searched plan {list(s.choice)} took {s.time * 1e3:.4g} ms ({how}) vs "
                f"{b.time * 1e3:.4g} ms")
        if s.time < b.time:
            lost += f", {_why_not_fastest(b, s)}"
        return f"chosen plan is the {self.baseline} baseline: {lost}"

    def margin_text(self) -> str:
        """How far the chosen plan is from the runner-up, and whether that is within the measured noise."""
        b = self.best
        kind = "estimated" if b.noise is None else "measured"
        others = [v for v in self.verified + self.layouts if v.key != b.key
                  and v.time != float("inf") and fits_budget(v.memory, self.budget)]
        won = f" ({b.label}{', a layout users write' if b.layout and b.layout != 'alpa-ilp' else ''})"
        if not others or b.time == float("inf"):
            return f"chosen plan{won}: {b.time * 1e3:.4g} ms {kind}; no runner-up within the budget"
        r = min(others, key=lambda v: v.time)
        diff = (r.time - b.time) / b.time * 100
        if b.noise is None:
            return (f"chosen plan{won}: {b.time * 1e3:.4g} ms estimated; runner-up ({r.label}) "
                    f"{r.time * 1e3:.4g} ms ({diff:+.1f}%, estimates are exact: ties only when equal)")
        tol = _tie_tolerance(b, r) * 100
        return (f"chosen plan{won}: {b.time * 1e3:.4g} ms measured; runner-up ({r.label}) {r.time * 1e3:.4g} ms "
                f"({diff:+.1f}%, {'within' if abs(diff) <= tol else 'outside'} measured noise ±{tol:.1f}%)")

    def candidates_text(self) -> str:
        """Every whole-step candidate: what it is, its time and memory, and whether it fits the budget."""
        how = self.time_label
        lines = [f"whole-step candidates ({how}; memory compiled):"]
        for v in sorted(self.verified + self.layouts, key=lambda v: v.time):
            over = not fits_budget(v.memory, self.budget)
            t = "not timed (over the budget)" if v.time == float("inf") else f"{v.time * 1e3:.4g} ms"
            mark = "  <- chosen" if v.key == self.best.key else ""
            lines.append(f"  {v.label:<28} {t:>12}  {fmt_bytes(v.memory)} per device"
                         f"{' (over the budget)' if over else ''}{mark}")
        return "\n".join(lines)


def fits_budget(memory: int, budget: int | None) -> bool:
    """Whether a compiled step's per-device bytes fit the budget: the one test of every candidate."""
    return budget is None or memory <= budget


def _why_not_fastest(chosen: VerifiedChoice, faster: VerifiedChoice) -> str:
    """Why `_best_fitting` chose `chosen` over the faster-timed `faster`."""
    if faster.remats and not chosen.remats:
        return f"but its compile made XLA rematerialize {faster.remats} tensors"
    if chosen.memory != faster.memory:
        why = f"the least memory ({fmt_bytes(chosen.memory)} vs {fmt_bytes(faster.memory)} per device)"
    elif chosen.comm_bytes != faster.comm_bytes:
        why = f"the least communication ({fmt_bytes(chosen.comm_bytes)} vs {fmt_bytes(faster.comm_bytes)})"
    else:
        why = "the smaller choice"
    return f"within the measured noise; the tie went to {why}"


def measure_link_gbps(mesh: jax.sharding.Mesh, nbytes: int = 1 << 22, iters: int = 5) -> float:
    """Per-direction link bandwidth seen by an all-gather over the whole mesh (the resharding estimate's unit)."""
    from jax.sharding import NamedSharding, PartitionSpec
    n = mesh.devices.size
    x = jax.device_put(np.zeros((n, nbytes // 4 // n), np.float32),
                       NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names))))
    f = jax.jit(lambda v: v + 0, out_shardings=NamedSharding(mesh, PartitionSpec()))
    t = time_compiled(f.lower(x).compile(), (x,), iters, 1)
    return max((n - 1) / n * nbytes / t / 1e9, 1e-3)


def comm_model(gpu: GpuSpec | None, options: SearchOptions, log=lambda *_: None) -> alpha_beta.AlphaBetaModel | None:
    """The alpha-beta model that prices resharding on this host's devices: their collectives as measured and
    fitted once per host (`cfp.hardware.alpha_beta`); a given `link_gbps` replaces its bandwidth, never its
    latency. None under `estimate` (bandwidth only, as before): priced with the catalog link's latencies
    (`alpha_beta.for_gpu`), the estimate's golden optima all turn data parallel, which the golden-plan tests
    (`tests/test_golden_plans.py`) would have to be re-derived for; see docs/limits.md."""
    if gpu is not None:
        return None
    model = alpha_beta.host_model(log=log)
    return model.with_bandwidth(options.link_gbps * 1e9) if options.link_gbps else model


def search(program: Program, analysis: Analysis, table: ProfileTable, example_args: Sequence[Any],
           options: SearchOptions | None = None, log: Callable[[str], None] = print,
           mesh: jax.sharding.Mesh | None = None) -> SearchResult:
    """The fastest choice within the memory budget; raises InfeasibleError when no choice fits."""
    options = options or SearchOptions()
    t0 = time.perf_counter()
    entries = _segment_entries(analysis, table, options.top_k)
    gpu = get_gpu(table.profiler.gpu) if table.profiler.kind is ProfilerKind.ESTIMATE else None
    mesh = mesh if mesh is not None else analysis.mesh.make()
    link = options.link_gbps or (gpu.link_gbps if gpu else measure_link_gbps(mesh))
    comm = comm_model(gpu, options, log)
    uniform = data_parallel_choice(analysis.graph, analysis.blocks)
    loops = LoopBodies(program, analysis, table, gpu, mesh) if analysis.graph.loops else None
    steps = StepCache(program, analysis, mesh)
    if options.budget_fraction is not None:
        options = _budget_of_data_parallel(analysis, example_args, options, steps=steps, log=log)
    scale, estimator = _calibrate(analysis, table, uniform, example_args, options=options, steps=steps, log=log)
    cands, cost, mem = _candidate_rows(analysis.segments, entries, estimator, scale, link, comm)
    trans = _transitions(analysis, cands, link, comm)
    solutions = _dp_solutions(cost, mem, trans, options, log)
    keys = [_solution_key(sol.picks, analysis.segments, cands) for sol in solutions]
    own = set(keys)
    if options.verify:
        solutions, keys = _with_uniform_choices(analysis, uniform, solutions, keys, options.shard_state)
    names = _uniform_labels(analysis, uniform)
    verified = [dataclasses.replace(_verify_solution(analysis, sol, choice, shard, example_args, steps=steps,
                                                     options=options, gpu=gpu, log=log, loops=loops),
                                    label="searched" if (choice, shard) in own else names[(choice, shard)])
                for sol, (choice, shard) in zip(solutions, keys)]
    layouts = (_layout_candidates(program, analysis, example_args, solutions[0], steps=steps, options=options,
                                  gpu=gpu, log=log, loops=loops, comm=comm)
               if options.verify and options.layouts else [])
    both = verified + layouts
    if gpu is None and options.verify:
        both = _time_side_by_side(both, steps, example_args, options, log)
    best = _best_fitting(both, options)
    baselines = {**names, **{v.key: v.label for v in layouts}}
    best, baseline, searched = _never_slower_than_baselines(best, both, baselines, own, options)
    verified, layouts = both[:len(verified)], both[len(verified):]
    if baseline:
        how = f"by the {gpu.name} cost model" if gpu else "measured side by side"
        log(f"chosen plan: the {baseline} baseline, faster than every searched plan ({how}) or tied with the "
            f"fastest within the noise")
    if any(v.remats for v in verified):
        log(f"{sum(1 for v in verified if v.remats)} of {len(verified)} verified plans reshard by replicating "
            f"(XLA: involuntary full rematerialization); the search prefers plans without")
    return SearchResult(best.choice, best.shard_state, best, tuple(verified), link, options.memory_per_device,
                        time.perf_counter() - t0, baseline=baseline, searched=searched, profiler=table.profiler,
                        steps=steps, layouts=tuple(layouts), comm=comm)


def _uniform_labels(analysis: Analysis, uniform) -> dict:
    """(choice, sharded-state blocks) -> name of cfp's own uniform plans (its constraints inside the step)."""
    every = tuple(range(len(analysis.blocks)))
    out = {(tuple(uniform), ()): "cfp data parallel", (tuple(uniform), every): "cfp ZeRO-3 per block"}
    tp = dp_tp_choice(analysis)
    if tp is not None:
        out.setdefault((tp, ()), "DP x TP (cfp's choice)")
        out.setdefault((tp, every), "DP x TP + ZeRO-3")
    return out


def _layout_candidates(program, analysis, example_args, sol: DPSolution, *, steps: "StepCache",
                       options: SearchOptions, gpu: GpuSpec | None, log, loops=None, comm=None
                       ) -> list[VerifiedChoice]:
    """The layouts users write for this step (data parallel, FSDP by input/output shardings alone, DP x TP by
    the Megatron rules) and the Alpa-style ILP's plan, each compiled whole (and estimated under `estimate`;
    measured later, side by side with the searched plans). A layout that does not apply is left out, said."""
    out = []
    for layout in (*USER_LAYOUTS, Layout.ALPA_ILP):
        try:
            shardings = (user_layout_shardings(layout, analysis, example_args) if layout in USER_LAYOUTS
                         else ilp_shardings(analysis, options.memory_per_device, _ilp_cost(gpu, comm)))
        except CfpError as e:
            log(f"{layout.label}: not a candidate here ({e})")
            continue
        step = steps.layout_step(layout, shardings)
        v = _verify(step, example_args, shardings.choice, (), sol.time, options=options, gpu=gpu,
                    analysis=analysis, loops=loops)
        out.append(dataclasses.replace(v, layout=layout.value, label=layout.label))
        log(f"{layout.label}: compiled whole, {fmt_bytes(v.memory)} per device"
            + (" (over the budget)" if v.time == float("inf") else ""))
    return out


def _ilp_cost(gpu: GpuSpec | None, comm):
    """The ILP's alpha-beta figures: the GPU's, else this host's fitted collectives (`comm`)."""
    from cfp.baselines.ilp import AlphaBeta
    if gpu is not None:
        return AlphaBeta.for_gpu(gpu)
    return AlphaBeta() if comm is None else AlphaBeta(bandwidth=comm.bandwidth, latency=comm.latency)


def _never_slower_than_baselines(best: VerifiedChoice, verified, baselines: dict, searched: set,
                                 options: SearchOptions):
    """(chosen plan, name of the baseline it is or None, fastest searched plan when a baseline won).

    The searched plans are held to the plain layouts: when data parallel or FSDP fits and is faster (side by
    side, or by the same cost model) than the pick, that baseline is returned instead. Profiles of segments in
    isolation, the DP's resharding estimates and the memory calibration can all mislead; the whole-step
    timings of the verification cannot. `searched`: the (choice, sharded state) keys the DP itself proposed."""
    budget = options.memory_per_device
    fits = [v for v in verified if v.time != float("inf") and fits_budget(v.memory, budget)]
    plain = [v for v in fits if v.key in baselines]
    if plain and min(v.time for v in plain) < best.time:
        best = min(plain, key=lambda v: v.time)
    key = best.key
    if key not in baselines or key in searched:
        return best, None, None
    own = [v for v in fits if v.key in searched]
    return best, baselines[key], min(own, key=lambda v: v.time) if own else None


def _segment_entries(analysis: Analysis, table: ProfileTable, top_k: int) -> list:
    """Per segment: the profiled choices the DP considers (the table's `top_k` fastest and leanest)."""
    if tuple(table.mesh_shape) != tuple(analysis.mesh.shape):
        raise ConfigError(f"profile table is for mesh {table.mesh_shape}, the analysis for {analysis.mesh.shape}")
    entries = []
    for s in analysis.segments:
        if s.kind not in table.segments:
            raise ConfigError(f"profile table has no entry for segment kind {s.kind} ({s.fingerprint})")
        entries.append(table.segments[s.kind].candidates(top_k))
    return entries


class StepCache(dict):
    """The search's sharded steps by (choice, sharded-state blocks), each built once on ``mesh`` and shared by the
    memory calibration, the verification and the side-by-side timing."""

    def __init__(self, program: Program, analysis: Analysis, mesh: jax.sharding.Mesh):
        super().__init__()
        self.program, self.analysis, self.mesh = program, analysis, mesh

    def step(self, choice, shard=()) -> ShardedStep:
        key = (tuple(choice), tuple(shard))
        if key not in self:
            self[key] = apply_choice(self.program, self.analysis, key[0], self.mesh, shard_state=key[1])
        return self[key]

    def layout_step(self, layout: Layout, shardings: StepShardings) -> ShardedStep:
        """The step of a `Layout` candidate (its key carries the layout's name)."""
        key = (tuple(shardings.choice), (), layout.value)
        if key not in self:
            self[key] = ShardedStep(self.program, self.analysis, shardings, self.mesh)
        return self[key]


def _budget_of_data_parallel(analysis, example_args, options: SearchOptions, *, steps: StepCache,
                             log) -> SearchOptions:
    """`options` with `memory_per_device` set to `budget_fraction` of plain data parallel's compiled per-device
    memory. Its step is the one `_layout_candidates` verifies (same `StepCache` key), so it compiles once."""
    shardings = user_layout_shardings(Layout.DATA_PARALLEL, analysis, example_args)
    step = steps.layout_step(Layout.DATA_PARALLEL, shardings)
    memory = _step_memory(step, compiled_memory(step.compile(*example_args)), options.donate)
    budget = max(1, int(memory * options.budget_fraction))
    log(f"budget: {options.budget_fraction:.0%} of plain data parallel's {fmt_bytes(memory)} per device "
        f"(compiled) = {fmt_bytes(budget)}")
    return dataclasses.replace(options, memory_per_device=budget, budget_fraction=None)


def _calibrate(analysis, table, uniform, example_args, *, options: SearchOptions, steps: StepCache, log):
    """(memory scale of the summed segment memories, state-sharding estimator or None), both calibrated on
    whole compiles of data parallel (plain, and with every block's state sharded) when verifying."""
    scale = (_memory_scale(analysis, table, uniform, example_args, steps=steps, log=log, donate=options.donate)
             if options.verify else 1.0)
    # Under a budget every candidate also exists with its state sharded (ZeRO-3): less memory, more gathering.
    estimator = (StateEstimator(analysis, uniform)
                 if options.memory_per_device is not None and options.shard_state else None)
    if estimator is not None and options.verify and (uniform, ()) in steps:
        _state_scale(analysis, estimator, uniform, example_args, steps=steps, log=log, donate=options.donate)
    return scale, estimator


def _candidate_rows(segs, entries, estimator: StateEstimator | None, scale: float, link: float, comm=None):
    """Per segment: its candidates (profile entry, state sharded?), their times and their memories."""
    cands, cost, mem = [], [], []
    for seg, ents in zip(segs, entries):
        # a loop body's segment was profiled for one iteration: it runs (and its weights are stacked) `repeat`
        # times; the state estimate already counts the stacked state whole
        row = [(e, False, 0.0, int(e.memory * scale * seg.repeat)) for e in ents]
        if estimator is not None:
            for e in ents:
                sv = estimator.segment(seg.blocks, e.choice)
                if sv.memory > 0:
                    row.append((e, True, sv.time(link * 1e9, comm.latency if comm is not None else 0.0),
                                max(int(e.memory * scale * seg.repeat) - sv.memory, 0)))
        cands.append([(e, z) for e, z, _, _ in row])
        cost.append([e.time * seg.repeat + extra for e, _, extra, _ in row])
        mem.append([m for _, _, _, m in row])
    return cands, cost, mem


def _transitions(analysis: Analysis, cands, link: float, comm=None) -> list:
    """Resharding seconds between every candidate of a segment and every candidate of the next, each
    collective priced by latency and bandwidth (`comm`, see `comm_model`)."""
    segs, trans = analysis.segments, []
    for i in range(len(segs) - 1):
        a = [analysis.segment_specs(segs[i], e.choice) for e, _ in cands[i]]
        b = [analysis.segment_specs(segs[i + 1], e.choice) for e, _ in cands[i + 1]]
        trans.append([[gpu_estimate.reshard_cost(analysis, x, y, link * 1e9, comm) for y in b] for x in a])
    return trans


def _dp_solutions(cost, mem, trans, options: SearchOptions, log) -> list[DPSolution]:
    """The DP's best solutions; over the budget by estimate, the leanest ones for whole-step verification."""
    budget = options.memory_per_device
    try:
        return dp_search(cost, mem, trans, budget, n_best=max(1, options.verify))
    except InfeasibleError:
        if not options.verify:
            raise
    # the summed estimate is approximate: compile the leanest choices whole before giving up
    log(f"estimated over the budget of {fmt_bytes(budget)}; verifying the leanest plans whole")
    lean = dp_search([[float(m) for m in row] for row in mem], mem,
                     [[[0.0] * len(t[0]) for _ in t] for t in trans], None, n_best=max(1, options.verify))
    return [DPSolution(p.picks, _solution_time(p.picks, cost, trans), p.memory) for p in lean]


def _with_uniform_choices(analysis: Analysis, uniform, solutions, keys, shard_states: bool):
    """As CFP does, uniform choices join the DP's best in the measured verification: profiles of segments
    in isolation can mislead (on a busy host above all), and whole-step data parallel (and DP x TP on a 2-D
    mesh) are the natural yardsticks; under a budget, also with their state sharded (data parallel so becomes
    FSDP). Their DP-estimated time is reported as the DP's best."""
    every = tuple(range(len(analysis.blocks)))
    solutions, keys = list(solutions), list(keys)
    for ref in (uniform, dp_tp_choice(analysis)):
        for shard in ((), every) if shard_states else ((),):
            if ref is not None and (ref, shard) not in keys:
                solutions.append(solutions[0])
                keys.append((ref, shard))
    return solutions, keys


def _verify_solution(analysis, sol: DPSolution, choice, shard, example_args, *, steps: StepCache,
                     options: SearchOptions, gpu: GpuSpec | None, log, loops=None) -> VerifiedChoice:
    """Compile (and unless `verify` is 0, time or estimate) one choice whole."""
    if options.verify == 0:
        return VerifiedChoice(choice=choice, shard_state=shard, dp_time=sol.time, time=sol.time, memory=sol.memory,
                              flops=0.0)
    step = steps.step(choice, shard)
    v = _verify(step, example_args, choice, shard, sol.time, options=options, gpu=gpu, analysis=analysis, loops=loops)
    timing = (f"({'estimated: ' + gpu.name + ' cost model'}) {v.time:.4g} s" if gpu else "timed below")
    log(f"plan {list(choice)}{' sharded state' if shard else ''}: DP estimate {sol.time:.4g} s, whole step "
        f"{'not timed (over the budget)' if v.time == float('inf') else timing}, "
        f"{fmt_bytes(v.memory)} per device"
        + (f", {v.remats} involuntary full rematerializations" if v.remats else ""))
    return v


def _time_side_by_side(verified, steps, example_args, options: SearchOptions, log) -> list[VerifiedChoice]:
    """Time every measured plan that fits, all of them in turn in each round: timed one after another, a burst
    of load on a shared host lands on one plan only (the demo once chose a plan 55% faster by its own timing
    window that was 4% slower side by side). Each plan is timed here only, not also alone before: its runs
    are what grows with a model's depth while its compile does not (a scanned step compiles in the same time
    at 2 and 64 layers), so they are bounded by `SearchOptions.timing_budget`."""
    fits = [k for k, v in enumerate(verified) if v.time != float("inf")
            and fits_budget(v.memory, options.memory_per_device)]
    if not fits:
        return verified
    runs = []
    host = host_copies(example_args)
    for k in fits:
        step = steps[verified[k].key]
        runs.append((step.compile(*example_args),
                     lambda step=step: jax.tree_util.tree_leaves(step.shard_args(*host))))
    # ten rounds where the budget allows: the spread of a few runs understates how much this host's timings wander
    timed = time_interleaved(runs, max(options.iters, 10), options.warmup, options.timing_budget, options.iters)
    out = list(verified)
    for k, (t, noise) in zip(fits, timed):
        out[k] = dataclasses.replace(verified[k], time=t, noise=noise)
    log("whole steps side by side (measured, interleaved): " + ", ".join(
        f"{out[k].label} {list(out[k].choice)[:4]}...{' sharded state' if out[k].shard_state else ''} "
        f"{out[k].time * 1e3:.4g} ms ±{out[k].noise * 100:.0f}%" for k in fits))
    return out


def host_copies(args):
    """`args` with every array leaf copied to host memory once (numpy), for placing them again before each
    timed run: a device array placed with another sharding goes through a slicing program that JAX compiles
    per shape and sharding (in `make demo`, 17 such compiles took 7.3 s at a host load of ~10), a host array
    is copied shard by shard. Typed PRNG keys (extended dtypes) have no numpy form and stay as they are."""
    def copy(x):
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            return np.asarray(x)
        return x
    return jax.tree_util.tree_map(copy, args)


def _tie_tolerance(a: VerifiedChoice, b: VerifiedChoice) -> float:
    return max(a.noise or 0.0, b.noise or 0.0)


def _best_fitting(verified, options: SearchOptions) -> VerifiedChoice:
    """The fastest fitting plan; plans within the measured noise of the fastest are tied and the tie goes to
    the least memory, then the least communication, then the smallest choice, so that reruns on one machine
    pick the same plan although their timings differ. Plans whose compile reported an involuntary full
    rematerialization only win when every fitting plan has one: the replicated copy is a memory peak and a
    cost that varies with the tensor, not with the plan's layout."""
    budget = options.memory_per_device
    fitting = [v for v in verified if options.verify == 0 or fits_budget(v.memory, budget)]
    if not fitting:
        smallest = min(v.memory for v in verified)
        raise InfeasibleError(f"memory budget {fmt_bytes(budget)} per device is infeasible: the smallest "
                              f"verified plan needs {fmt_bytes(smallest)} ({smallest} bytes) per device")
    fitting = [v for v in fitting if not v.remats] or fitting
    fastest = min(fitting, key=lambda v: v.time)
    tied = [v for v in fitting if v.time <= fastest.time * (1 + _tie_tolerance(fastest, v))]
    return min(tied, key=lambda v: (v.memory, v.comm_bytes, v.shard_state, v.choice, v.layout))


def _solution_key(picks, segs, cands) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(choice, sharded-state blocks) of a DP solution."""
    choice = tuple(c for i, p in enumerate(picks) for c in cands[i][p][0].choice)
    shard = tuple(sorted(b for i, p in enumerate(picks) if cands[i][p][1] for b in segs[i].blocks))
    return choice, shard


def _solution_time(picks, cost, trans) -> float:
    t = sum(cost[i][p] for i, p in enumerate(picks))
    return t + sum(trans[i][picks[i]][picks[i + 1]] for i in range(len(picks) - 1))


def _step_memory(step: ShardedStep, memory: int, donate: bool) -> int:
    """Per-device bytes of a compiled step; with donation, the state inputs its outputs take over count once."""
    return memory - donated_bytes(step.analysis, step.shardings) if donate else memory


def _memory_scale(analysis, table, uniform, example_args, *, steps: StepCache, log, donate=False) -> float:
    """whole-step memory / sum of segment memories, measured on the data-parallel plan.

    Segments profiled alone each count their own peak of temporaries, while the whole step reuses buffers
    across segments; one whole compile of a reference plan calibrates the sum the DP adds up.
    """
    total = 0
    for seg in analysis.segments:
        choice = tuple(uniform[b] for b in seg.blocks)
        entry = next((e for e in table.segments[seg.kind].entries if tuple(e.choice) == choice), None)
        if entry is None:     # a table made elsewhere may lack it; the profiler always profiles it
            log(f"memory calibration skipped: segment kind {seg.kind} has no profile of the data-parallel "
                f"choice {list(choice)}; segment memories are summed unscaled")
            return 1.0
        total += entry.memory * seg.repeat
    step = steps.step(uniform)
    whole = _step_memory(step, compiled_memory(step.compile(*example_args)), donate)
    scale = whole / total if total else 1.0
    log(f"memory calibration: data-parallel plan {fmt_bytes(whole)} whole vs {fmt_bytes(total)} summed over "
        f"segments: segment memories x{scale:.2f}")
    return scale


def _state_scale(analysis, estimator: StateEstimator, uniform, example_args, *, steps: StepCache, log,
                 donate=False) -> None:
    """Calibrate the state-sharding savings on one whole compile: data parallel with every block's state
    sharded (FSDP) against plain data parallel."""
    every = tuple(range(len(analysis.blocks)))
    step = steps.step(uniform, every)
    plain = steps.step(uniform)
    actual = (_step_memory(plain, compiled_memory(plain.compile(*example_args)), donate)
              - _step_memory(step, compiled_memory(step.compile(*example_args)), donate))
    est = sum(estimator.segment(seg.blocks, tuple(uniform[b] for b in seg.blocks)).memory
              for seg in analysis.segments)
    if est > 0 and actual > 0:
        estimator.scale = actual / est
        log(f"state-sharding calibration: data parallel saves {fmt_bytes(actual)} whole vs {fmt_bytes(est)} "
            f"estimated: savings x{estimator.scale:.2f}")


def _verify(step: ShardedStep, example_args, choice, shard, dp_time, *, options: SearchOptions,
            gpu: GpuSpec | None, analysis: Analysis, loops: LoopBodies | None = None) -> VerifiedChoice:
    """One choice's whole-step figures: measured or estimated time, compiled memory, FLOPs (with `loops`, the
    loop bodies' iterations that XLA's figures count once are added)."""
    compiled = step.compile(*example_args)
    remats = len(step.rematerializations(*example_args))
    budget = options.memory_per_device
    shape = analysis.mesh.shape
    fig = compiled_figures(compiled, shape, collectives=True)
    fig = dataclasses.replace(fig, memory=_step_memory(step, fig.memory, options.donate))
    noise = None
    if not fits_budget(fig.memory, budget):
        t = float("inf")      # does not fit: not worth timing
    elif gpu is None:
        t, noise = float("nan"), 0.0      # measured by `_time_side_by_side`, with every other fitting plan
    else:
        dtype = gpu_estimate.dominant_dtype(analysis, range(len(analysis.blocks)))
        rate = gpu_estimate.dots_rate(analysis, enumerate(choice), gpu)
        t = gpu_estimate.estimated_time(fig, shape, gpu, dtype, rate)
    extra_t, extra_flops = loops.extra(choice) if loops is not None else (0.0, 0.0)
    if gpu is not None:
        t += extra_t
    fig = dataclasses.replace(fig, flops=fig.flops + extra_flops)
    return VerifiedChoice(choice=tuple(choice), shard_state=tuple(shard), dp_time=dp_time, time=t, memory=fig.memory,
                          flops=fig.flops * analysis.mesh.size, noise=noise,
                          comm_bytes=sum(c.bytes for c in fig.collectives), remats=remats)
