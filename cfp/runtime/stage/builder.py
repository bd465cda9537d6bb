"""How a stage is built: from the rules table or from a searched plan (its programs cut from the analysed stage
step), always through the engine's `CompileCache`; and which plans a training run builds from (`plans_for_run`:
none, searched, saved, or those of the checkpointed run)."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import jax

from cfp.errors import ConfigError
from cfp.layout import Layout
from cfp.runtime.stage.cache import Built, CompileCache
from cfp.runtime.stage.cases import StageCase, analysed_step, megatron_program, replay_program, stage_cases
from cfp.runtime.stage.plan_search import search_stage_plans
from cfp.runtime.stage.plans import PLANS_FILE, StagePlan, StagePlanMode, StagePlanOptions, StagePlans, entries
from cfp.sharding.specs import resolve


def _planned_programs(plans: StagePlans, layout: Layout, cache: CompileCache, devices: list,
                      batch_like: Any) -> dict:
    """Stage key -> `StageProgram` of every stage whose plan runs a searched choice (the others run the rules
    table). Programs the search built come from `cache`; saved plans are re-analysed (no profiling, no search) and
    checked against the analysis: same blocks, same strategies, same parameter layouts."""
    by_key = plans.by_key()
    out = {}
    for case in stage_cases(layout, cache, batch_like, devices):
        plan = by_key[case.prog.stage.key]
        if plan.runs_searched:
            choice = plan.plan_choice()
            built = cache.find(Built.PROGRAM, case.program_key(choice))
            out[plan.key] = built or replay_program(case, choice, _checked(plan, case, cache), cache)
    return out


def _checked(plan: StagePlan, case: StageCase, cache: CompileCache):
    """The plan's `StepShardings` on the stage's analysed step; ConfigError if the plan does not fit it."""
    analysis = analysed_step(case, cache).analysis
    s = plan.sharding
    fits = len(s.choice) == len(analysis.blocks) and all(
        c < len(b.strategies) for b, c in zip(analysis.blocks, s.choice))
    notation = tuple(analysis.notation(b, c) for b, c in enumerate(s.choice)) if fits else None
    applied = resolve(analysis, s.choice, s.shard_state) if notation == s.strategies else None
    specs = applied and tuple(entries(x) for x in applied.input_specs[:len(s.params)])
    if applied is None or specs != tuple(e for _, e in s.params):
        raise ConfigError(f"stage plan of stage {plan.key} does not fit the analysed stage step "
                          f"({len(analysis.blocks)} blocks): it was made by another cfp or model code; "
                          "search again")
    return applied


def check_devices(layout: Layout, devices: list) -> None:
    for st in layout.placed:
        procs = sorted({devices[d].process_index for d in st.devices})
        if len(procs) > 1:
            raise ConfigError(
                f"stage {st.key} uses devices {list(st.devices)} of processes {procs}; a stage's devices "
                f"must belong to one process (choose devices_id accordingly)")


def needs_search(cache: CompileCache, layout: Layout) -> list:
    """Stages with TP > 1 whose model names no parameter dims: the rules table would leave them replicated."""
    if cache.model.logical_names is not None:
        return []
    return [st.key for st in layout.placed if st.tp > 1]


def build_programs(layout: Layout, devices: list, cache: CompileCache, plans: Optional[StagePlans] = None,
                   batch_like: Any = None) -> dict:
    """Every stage's `StageProgram` through `cache`: a searched plan's where `plans` has one that runs (for batches
    shaped like `batch_like`), the rules table's elsewhere."""
    check_devices(layout, devices)
    if plans is not None and batch_like is None:
        raise ConfigError("stage plans need the shape of the batches (an example batch) to rebuild their programs")
    planned = _planned_programs(plans, layout, cache, devices, batch_like) if plans else {}
    unnamed = [k for k in needs_search(cache, layout) if k not in planned and not (
        plans and not plans.by_key()[k].runs_searched)]
    if unnamed:
        raise ConfigError(f"stages {unnamed} have TP > 1 but model {cache.model.name!r} names no parameter dims "
                          "(logical_names): search their stage plans (--stage-plans search) or name the dims "
                          "(nn.with_logical_partitioning, nnx.with_partitioning)")
    return {st.key: planned.get(st.key) or megatron_program(st, [devices[d] for d in st.devices], cache)
            for st in layout.placed}


def plans_for_run(options: Optional[StagePlanOptions], layout: Layout, cache: CompileCache, batch_like: Any,
                  checkpoint_dir: Optional[str] = None, resume: bool = False,
                  log: Callable[[str], None] = print) -> Optional[StagePlans]:
    """The stage plans of a training run (None: the rules table) from the run's stage-plan `options` (None: the
    rules table), its layout and an example batch: the one call a run makes into the stage planner. A model that
    names no parameter dims gets its TP stages searched. A resumed run reuses the plans saved next to its
    checkpoints; a searched run saves them there (``<checkpoint_dir>/stage_plans``) and leaves the programs it
    built in `cache`."""
    unnamed = needs_search(cache, layout)
    if unnamed and (options is None or options.mode is StagePlanMode.MEGATRON):
        log(f"model {cache.model.name!r} names no parameter dims: the stage plans of its TP stages {unnamed} "
            "are searched (the CFP passes per stage)")
        options = StagePlanOptions(StagePlanMode.SEARCH)
    if options is None or options.mode is StagePlanMode.MEGATRON:
        return None
    saved_dir = os.path.join(checkpoint_dir, "stage_plans") if checkpoint_dir else None
    name = cache.model.name
    if options.mode is StagePlanMode.SAVED:
        plans = StagePlans.load(options.directory).check(layout, name, batch_like)
        log(f"stage plans loaded from {options.directory} (no search)")
    elif resume and saved_dir and _fits(saved_dir, layout, name, batch_like, log):
        plans = StagePlans.load(saved_dir)
        log(f"stage plans of the checkpointed run reused from {saved_dir} (no search)")
    else:
        if jax.process_count() > 1:
            # the search compiles and times every stage on devices one process cannot all address
            raise ConfigError("--stage-plans search runs in a single process; search there and pass the "
                              "saved stage-plans directory (--stage-plans DIR) to the multi-process run")
        t0 = time.perf_counter()
        plans = search_stage_plans(layout, cache, options, batch_like, log=log)
        log(f"stage plans searched in {time.perf_counter() - t0:.1f} s")
    if saved_dir and jax.process_index() == 0:
        log(f"stage plans saved to {plans.save(saved_dir)}")
    return plans


def _fits(directory: str, layout: Layout, model_name: str, batch_like: Any, log) -> bool:
    """Whether `directory` holds stage plans for this layout (a run may resume onto another layout)."""
    if not os.path.isfile(os.path.join(directory, PLANS_FILE)):
        return False
    try:
        StagePlans.load(directory).check(layout, model_name, batch_like)
        return True
    except ConfigError as e:
        log(f"not reusing the checkpointed stage plans: {e}")
        return False
