"""How a stage is built: from the rules table or from a searched plan (its programs cut from the analysed stage
step), always through the engine's `CompileCache` (where a run's plans come from: `plan_sources`)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from cfp.errors import ConfigError
from cfp.layout import Layout
from cfp.recompute import Recompute
from cfp.runtime.stage.cache import Built, CompileCache
from cfp.runtime.stage.cases import StageCase, analysed_step, megatron_program, replay_program, stage_cases
from cfp.runtime.stage.plans import StagePlan, StagePlans, entries
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
                   batch_like: Any = None, recompute: Callable[[tuple], Recompute] = lambda key: Recompute.NONE
                   ) -> dict:
    """Every stage's `StageProgram` through `cache`: a searched plan's where `plans` has one that runs (for batches
    shaped like `batch_like`), the rules table's elsewhere, under the policy ``recompute(stage key)``."""
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
    return {st.key: planned.get(st.key) or megatron_program(st, [devices[d] for d in st.devices], cache,
                                                            recompute(st.key))
            for st in layout.placed}
