"""Options of the heterogeneous-cluster planner (one dataclass, validated on construction)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

from cfp.errors import ConfigError
from cfp.planner.measured import MeasuredStageTimes
from cfp.planner.step_features import StepFeatures
from cfp.recompute import Recompute
from cfp.schedules.registry import ScheduleName, ScheduleSpec, schedule_choices


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ConfigError(f"PlannerOptions.{name}={v!r} must be a positive integer")
    return int(v)


@dataclass(frozen=True)
class PlannerOptions:
    """`global_batch_size` sequences per step; `micro_batch_sizes` tried per micro-batch;
    `max_pipelines` caps the data-parallel degree searched (None: as many as the batch allows);
    `schedule`: one schedule, a list of them or "auto" (`cfp.schedules.registry.schedule_choices`): each pipeline
    runs the fastest of them whose memory fits;
    `refine_evaluations` bounds the local refinement (a count, not a time, so plans are deterministic);
    `phase2_metis` offers METIS' compute-balanced stage cut next to one TP degree per device type
    (off: the latter only, for comparison); `stage_times`: measured stage times that replace the
    analytic ones for stages of their shape and device (`cfp plan --stage-times`); `recompute`: every stage's
    recompute policy (`cfp.recompute.Recompute`), or "auto": per stage the least recomputation whose kept
    activations fit its memory under its schedule."""
    global_batch_size: int
    schedule: Any = ScheduleName.ONE_F_ONE_B
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_pipelines: int | None = None
    refine: bool = True
    refine_evaluations: int = 3000
    phase2_metis: bool = True
    stage_times: Optional[MeasuredStageTimes] = None
    recompute: Recompute = Recompute.AUTO

    def __post_init__(self):
        object.__setattr__(self, "recompute", Recompute.parse(self.recompute, "PlannerOptions.recompute"))
        _positive("global_batch_size", self.global_batch_size)
        schedule_choices(self.schedule)      # validates
        if not isinstance(self.micro_batch_sizes, (list, tuple)) or not self.micro_batch_sizes:
            raise ConfigError(f"PlannerOptions.micro_batch_sizes={self.micro_batch_sizes!r} must list at least "
                              "one size, e.g. (1, 2, 4)")
        object.__setattr__(self, "micro_batch_sizes",
                           tuple(sorted({_positive("micro_batch_sizes", m) for m in self.micro_batch_sizes})))
        if self.max_pipelines is not None:
            _positive("max_pipelines", self.max_pipelines)
        _positive("refine_evaluations", self.refine_evaluations)
        for name in ("refine", "phase2_metis"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"PlannerOptions.{name}={getattr(self, name)!r} must be True or False")
        if self.stage_times is not None and not isinstance(self.stage_times, MeasuredStageTimes):
            raise ConfigError(f"PlannerOptions.stage_times={self.stage_times!r} must be a MeasuredStageTimes")

    @property
    def features(self) -> StepFeatures:
        """How the planned step runs: cfp's runtime with these recompute policies."""
        return StepFeatures(recompute=self.recompute)

    @property
    def choices(self) -> tuple[ScheduleSpec, ...]:
        """The schedules a pipeline may run, the base (what stages are sized by) first."""
        return schedule_choices(self.schedule)
