"""Searched intra-operator plans for every stage of a heterogeneous pipeline (the CFP passes per stage).

For each stage — its layers, its TP sub-mesh, its pipeline's micro-batch and its per-device memory — the
stage's training step on one micro-batch (`cfp.runtime.stage.replay.stage_step`: forward, ``jax.vjp``
backward, gradient accumulation and the stage's optimizer update, built from the stage functions of `StageProgram`) is
analysed, its unique segments are profiled (through the profile cache, so segments with the same shapes on
the same sub-mesh are shared by stages, pipelines and later runs) and per-block strategies are searched under
the memory budget, parameter/optimizer-state sharding (ZeRO-3) included. Among the verified plans the search's
step time plus the boundary transfer — the bytes each of the stage's devices receives for its incoming
input (micro-batch or activation) and outgoing activation's gradient in the layouts that plan gives them, from
their shapes — picks the winner, which is then timed side by side with the stage's rules-table (Megatron)
sharding (`cfp.runtime.stage.compare`: both stages' runtime programs, timed in turns); the faster one runs, so
a stage plan is never slower than Megatron beyond the measured noise.

Everything the search builds — analysed steps, replays, the stage programs it timed — is kept in the engine's
`CompileCache`, so the trainer handed the same cache runs those programs without building them again.
Stages of one device need no search (everything replicated).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional

import jax

from cfp.errors import InfeasibleError
from cfp.layout import Layout
from cfp.profiling.profiler import profile
from cfp.runtime.stage.boundary import boundary_seconds
from cfp.runtime.stage.cache import CompileCache
from cfp.runtime.stage.cases import AnalysedStep, StageCase, analysed_step, replay_program, stage_cases
from cfp.runtime.stage.compare import compare_with_megatron
from cfp.runtime.stage.plans import (SearchedSharding, SearchFigures, StagePlan, StagePlanOptions, StagePlans,
                                     Timing, batch_entries, entries)
from cfp.runtime.stage.replay import input_groups
from cfp.search.options import SearchOptions
from cfp.search.search import VerifiedChoice, search
from cfp.sharding.specs import StepShardings, resolve
from cfp.xla.log import quiet_compiles


@dataclasses.dataclass(frozen=True)
class Picked:
    """The verified choice with the least step time plus boundary transfer, resolved, and that transfer."""
    verified: VerifiedChoice
    applied: StepShardings
    boundary: float        # seconds per micro-batch (estimated)

    @property
    def plan_choice(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(self.verified.choice), tuple(self.verified.shard_state)


def _boundary_specs(case: StageCase, step: AnalysedStep, applied: StepShardings) -> tuple[list, list]:
    """(layouts of the stage's input leaves -- the micro-batch on the first stage, else the activation --, layouts
    of its output gradient's leaves) under `applied`."""
    groups = input_groups(step.program)
    specs = applied.input_specs
    incoming = groups["batch"] if case.prog.stage.is_first else groups["x"]
    return [specs[i] for i in incoming], [specs[i] for i in groups["g_y"]]


def _pick(case: StageCase, step: AnalysedStep, result, budget) -> Picked:
    """The verified choice of search `result` within `budget` with the least step time plus boundary transfer."""
    best = None
    for v in result.verified:
        if not math.isfinite(v.time) or (budget is not None and v.memory > budget):
            continue
        applied = resolve(step.analysis, v.choice, v.shard_state)
        b = boundary_seconds(case, *_boundary_specs(case, step, applied), result.link_gbps)
        if best is None or v.time + b < best.verified.time + best.boundary:
            best = Picked(v, applied, b)
    if best is None:
        raise InfeasibleError(f"stage {case.prog.stage.key}: no verified plan fits {budget} bytes per device")
    return best


def _sharding(case: StageCase, step: AnalysedStep, picked: Picked) -> SearchedSharding:
    n_params = len(jax.tree_util.tree_leaves(step.args[0]))
    specs = picked.applied.input_specs
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(case.prog.params_like)[0]]
    v = picked.verified
    act_in, act_out = _boundary_specs(case, step, picked.applied)
    return SearchedSharding(
        tuple(v.choice), tuple(step.analysis.notation(b, c) for b, c in enumerate(v.choice)),
        tuple(v.shard_state), tuple((k, entries(s)) for k, s in zip(paths, specs[:n_params])),
        tuple(entries(s) for s in act_in), tuple(entries(s) for s in act_out))


def search_stage(case: StageCase, cache: CompileCache, sopts: SearchOptions,
                 log: Callable[[str], None] = print) -> StagePlan:
    """Analyse, profile and search one stage on its own sub-mesh under `sopts` (its ``memory_per_device`` the
    stage's budget), then time the winner side by side with the Megatron sharding; see the module doc. The
    programs it builds stay in `cache`."""
    st = case.prog.stage
    marks = [time.perf_counter()]
    step = analysed_step(case, cache)
    marks.append(time.perf_counter())
    quiet = lambda *_: None
    # candidate compiles: the profile, the verified whole steps and the side by side with Megatron
    with quiet_compiles(f"stage p{st.pipeline}s{st.index} candidate compiles"):
        table = profile(step.program, step.analysis, sopts.profile, log=quiet)
        marks.append(time.perf_counter())
        result = search(step.program, step.analysis, table, step.args, sopts, log=quiet, mesh=case.prog.mesh)
        marks.append(time.perf_counter())
        picked = _pick(case, step, result, sopts.memory_per_device)
        planned = lambda: replay_program(case, picked.plan_choice, picked.applied, cache)
        meg = compare_with_megatron(case, step, result, picked, planned, sopts, table.profiler)
    marks.append(time.perf_counter())
    v = picked.verified
    searched = Timing(meg.searched_time if meg and not meg.same_sharding else float(v.time),
                      float(picked.boundary), int(v.memory))
    figures = SearchFigures(searched, meg and Timing(meg.megatron_time, meg.megatron_boundary, meg.megatron_memory),
                            str(table.profiler), int(table.compiles), marks[-1] - marks[0])
    plan = StagePlan(st.pipeline, st.index, st.tp, (st.layer_start, st.layer_end), case.micro_batch,
                     _sharding(case, step, picked), figures, bool(meg and (meg.megatron_wins or meg.same_sharding)))
    log(f"stage p{st.pipeline}s{st.index} (TP {st.tp}, {len(step.analysis.blocks)} blocks, "
        f"{step.analysis.num_unique_segments} unique segments): profiled {table.compiles} combinations "
        f"({'nothing compiled, all from the profile cache' if table.compiles == 0 else 'compiled'}), "
        f"planned in {figures.planning_time:.1f} s (analysis {marks[1] - marks[0]:.1f}, profiling "
        f"{marks[2] - marks[1]:.1f}, search with {len(result.verified)} whole steps verified "
        f"{marks[3] - marks[2]:.1f}, Megatron side by side {marks[4] - marks[3]:.1f}; measured)"
        + (f"; {meg.text()}" if meg else "") + f": {plan.summary()}")
    return plan


def _placed(plan: StagePlan, st) -> StagePlan:
    return dataclasses.replace(plan, pipeline=st.pipeline, stage=st.index)


def search_stage_plans(layout: Layout, cache: CompileCache, options: StagePlanOptions, batch_like: Any,
                       devices: Optional[list] = None, log: Callable[[str], None] = print) -> StagePlans:
    """Search every stage's plan (stages equal in layers, TP and micro-batch are searched once) for batches shaped
    like `batch_like`; the stage programs built on the way stay in `cache` for the engine."""
    done: dict[tuple, StagePlan] = {}
    plans = []
    for case in stage_cases(layout, cache, batch_like, devices):
        st = case.prog.stage
        key = case.step_key
        if st.tp == 1:
            plan = StagePlan(st.pipeline, st.index, st.tp, (st.layer_start, st.layer_end), case.micro_batch)
        elif key in done:
            plan = _placed(done[key], st)
        else:
            plan = done[key] = search_stage(case, cache, options.search_options(), log)
        plans.append(plan)
    devices = list(devices) if devices is not None else jax.devices()
    model = cache.model
    config = dataclasses.asdict(model.config) if dataclasses.is_dataclass(model.config) else {}
    return StagePlans(model.name, layout, tuple(plans), config, device_kind(devices[0]),
                      batch_entries(batch_like))


def device_kind(device) -> str:
    """The GPU-catalog-style name of the device stage times were taken on ("cpu" for host devices)."""
    return "cpu" if device.platform == "cpu" else str(device.device_kind)
