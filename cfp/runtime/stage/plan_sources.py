"""Where a training run's stage plans come from, one source per `StagePlanMode` in a registry (`PLAN_SOURCES`):
the rules table (no plans), plans saved earlier, or the CFP search per stage (reusing the plans saved next to the
checkpoints of the run it resumes). `plans_for_run` is the one call a run makes into the stage planner."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional, Protocol

import jax

from cfp.errors import ConfigError
from cfp.layout import Layout
from cfp.runtime.stage.builder import needs_search
from cfp.runtime.stage.cache import CompileCache
from cfp.runtime.stage.plan_search import search_stage_plans
from cfp.runtime.stage.plans import PLANS_FILE, StagePlanMode, StagePlanOptions, StagePlans


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What a plan source is given: the run's stage-plan options, layout, compile cache (the search leaves the
    programs it built there), an example batch, and where the run keeps its checkpoints (None: nowhere)."""
    options: StagePlanOptions
    layout: Layout
    cache: CompileCache
    batch_like: Any
    checkpoint_dir: Optional[str] = None
    resume: bool = False
    log: Callable[[str], None] = print

    @property
    def saved_dir(self) -> Optional[str]:
        """Where a run keeps its stage plans: ``<checkpoint_dir>/stage_plans``."""
        return os.path.join(self.checkpoint_dir, "stage_plans") if self.checkpoint_dir else None


class PlanSource(Protocol):
    def stage_plans(self, request: PlanRequest) -> Optional[StagePlans]: ...


class RulesTable:
    """No plans: every stage runs the rules table on the model's logical dim names."""

    def stage_plans(self, request: PlanRequest) -> None:
        return None


class SavedPlans:
    """Plans saved earlier (``--stage-plans DIR``), checked against the layout, model and batch."""

    def stage_plans(self, request: PlanRequest) -> StagePlans:
        plans = _checked(request.options.directory, request)
        request.log(f"stage plans loaded from {request.options.directory} (no search)")
        return plans


class SearchedPlans:
    """The CFP passes per stage; a resumed run reuses the plans saved next to its checkpoints when they fit its
    layout (a run may resume onto another layout)."""

    def stage_plans(self, request: PlanRequest) -> StagePlans:
        saved = request.saved_dir
        reused = _reusable(saved, request) if request.resume and saved else None
        if reused is not None:
            request.log(f"stage plans of the checkpointed run reused from {saved} (no search)")
            return reused
        if jax.process_count() > 1:
            # the search compiles and times every stage on devices one process cannot all address
            raise ConfigError("--stage-plans search runs in a single process; search there and pass the "
                              "saved stage-plans directory (--stage-plans DIR) to the multi-process run")
        t0 = time.perf_counter()
        plans = search_stage_plans(request.layout, request.cache, request.options, request.batch_like,
                                   log=request.log)
        request.log(f"stage plans searched in {time.perf_counter() - t0:.1f} s")
        return plans


PLAN_SOURCES: dict[StagePlanMode, PlanSource] = {
    StagePlanMode.MEGATRON: RulesTable(),
    StagePlanMode.SAVED: SavedPlans(),
    StagePlanMode.SEARCH: SearchedPlans(),
}


def _checked(directory: str, request: PlanRequest) -> StagePlans:
    """The stage plans saved in `directory`; ConfigError unless made for the request's layout, model and batch."""
    return StagePlans.load(directory).check(request.layout, request.cache.model.name, request.batch_like)


def _reusable(directory: str, request: PlanRequest) -> Optional[StagePlans]:
    """The stage plans in `directory` where it holds plans for the request (a run may resume onto another
    layout), else None."""
    if not os.path.isfile(os.path.join(directory, PLANS_FILE)):
        return None
    try:
        return _checked(directory, request)
    except ConfigError as e:
        request.log(f"not reusing the checkpointed stage plans: {e}")
        return None


def plans_for_run(request: PlanRequest) -> Optional[StagePlans]:
    """The stage plans of a training run (None: the rules table) from the source its options name. A model that
    names no parameter dims gets its TP stages searched; plans are saved next to the run's checkpoints
    (``<checkpoint_dir>/stage_plans``) so that a resumed run reuses them."""
    unnamed = needs_search(request.cache, request.layout)
    if unnamed and request.options.mode is StagePlanMode.MEGATRON:
        request.log(f"model {request.cache.model.name!r} names no parameter dims: the stage plans of its TP "
                    f"stages {unnamed} are searched (the CFP passes per stage)")
        request = dataclasses.replace(request, options=StagePlanOptions(StagePlanMode.SEARCH))
    plans = PLAN_SOURCES[request.options.mode].stage_plans(request)
    if plans is not None and request.saved_dir and jax.process_index() == 0:
        request.log(f"stage plans saved to {plans.save(request.saved_dir)}")
    return plans
