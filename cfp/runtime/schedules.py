"""Pipeline schedules as data, with the one pipeline-time formula the planner and the data pass price them by.

A schedule maps ``(num_stages, num_microbatches)`` to one ordered action list per stage; an action
is ``(Phase, microbatch)``; its entry in `SCHEDULES` also says how many micro-batch inputs a stage keeps
between forward and backward and how long a pipeline takes (`pipeline_time`). ``global_order`` merges the
per-stage lists of several pipelines into a single dependency-respecting order by simulating unit-time ticks,
which is the order the executor dispatches in (every process of a multi-process run walks the same order,
so cross-process transfers are issued identically everywhere).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, Union

from cfp.errors import ConfigError


class Phase(str, enum.Enum):
    FWD = "fwd"
    BWD = "bwd"


class ScheduleName(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"

    @classmethod
    def parse(cls, name: "str | ScheduleName") -> "ScheduleName":
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"unknown schedule {name!r}; valid choices: "
                              f"{', '.join(s.value for s in cls)}") from None


class Action(NamedTuple):
    phase: Phase
    microbatch: int


StageActions = list[list[Action]]  # [stage] -> ordered actions


def gpipe(num_stages: int, num_microbatches: int) -> StageActions:
    """All forwards, then all backwards (backwards in micro-batch order)."""
    return [[Action(Phase.FWD, m) for m in range(num_microbatches)]
            + [Action(Phase.BWD, m) for m in range(num_microbatches)]
            for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> StageActions:
    """Non-interleaved 1F1B (PipeDream-flush): warm-up forwards, alternate, drain backwards."""
    out = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, num_microbatches)
        acts = [Action(Phase.FWD, m) for m in range(warm)]
        for i in range(num_microbatches - warm):
            acts += [Action(Phase.FWD, warm + i), Action(Phase.BWD, i)]
        acts += [Action(Phase.BWD, m) for m in range(num_microbatches - warm, num_microbatches)]
        out.append(acts)
    return out


def pipeline_time(stage_seconds: Sequence[float], microbatches: Union[Sequence[float], int]) -> float:
    """Seconds of one pipeline pass under a non-interleaved schedule (GPipe, 1F1B): the longest path through the
    stage x micro-batch grid whose cell (i, j) takes ``stage_seconds[i] * w[j]``, taken as

        sum_i s_i * max w  +  sum_j w_j * max s  -  max s * max w

    -- exact when every micro-batch costs alike (``microbatches`` an int c, w = 1: the planner's sum of the stage
    times plus (c-1) times the slowest, FlashFlex/HexiScale) or every stage does (``stage_seconds`` all 1, w the
    micro-batch costs: Hydraulis' sum of the micro-batches plus (pp-1) times the slowest)."""
    if not stage_seconds:
        return 0.0
    if isinstance(microbatches, int):
        w_sum, w_max = float(microbatches), 1.0
    else:
        if len(microbatches) == 0:
            return 0.0
        w_sum, w_max = float(sum(microbatches)), float(max(microbatches))
    s_max = max(stage_seconds)
    return sum(stage_seconds) * w_max + (w_sum - w_max) * s_max


def _store_all(stage: int, num_stages: int, chunks: int) -> int:
    return chunks


def _store_in_flight(stage: int, num_stages: int, chunks: int) -> int:
    return min(chunks, num_stages - stage)


@dataclass(frozen=True)
class Schedule:
    """One schedule as data: ``actions(num_stages, chunks)`` per stage, ``stored_inputs(stage, num_stages, chunks)``
    the micro-batch inputs a stage keeps between forward and backward (its activation memory), ``time`` the
    pipeline-time formula. Calling it gives its actions."""
    name: ScheduleName
    actions: Callable[[int, int], StageActions]
    stored_inputs: Callable[[int, int, int], int]
    time: Callable[[Sequence[float], Union[Sequence[float], int]], float] = pipeline_time

    def __call__(self, num_stages: int, num_microbatches: int) -> StageActions:
        return self.actions(num_stages, num_microbatches)


SCHEDULES: dict[ScheduleName, Schedule] = {
    ScheduleName.GPIPE: Schedule(ScheduleName.GPIPE, gpipe, _store_all),
    ScheduleName.ONE_F_ONE_B: Schedule(ScheduleName.ONE_F_ONE_B, one_f_one_b, _store_in_flight),
}


class GlobalAction(NamedTuple):
    pipeline: int
    stage: int
    phase: Phase
    microbatch: int
    tick: int


def _deps(p: int, s: int, a: Action, num_stages: int) -> list[tuple]:
    if a.phase is Phase.FWD:
        return [(p, s - 1, Phase.FWD, a.microbatch)] if s > 0 else []
    deps = [(p, s, Phase.FWD, a.microbatch)]
    if s < num_stages - 1:
        deps.append((p, s + 1, Phase.BWD, a.microbatch))
    return deps


def check_schedule(actions: StageActions, num_microbatches: int) -> None:
    """Every stage runs each micro-batch's forward and backward exactly once."""
    want = sorted((ph, m) for ph in Phase for m in range(num_microbatches))
    for s, acts in enumerate(actions):
        if sorted((a.phase, a.microbatch) for a in acts) != want:
            raise ConfigError(f"schedule stage {s} does not run every forward and backward once")


def global_order(per_pipeline: Sequence[StageActions]) -> list[GlobalAction]:
    """Merge per-stage action lists into one order by a unit-time tick simulation.

    At each tick every stage runs its next action if all its dependencies finished in an earlier
    tick; actions within a tick are ordered by (pipeline, stage).  Raises if a schedule deadlocks.
    """
    pos = [[0] * len(stages) for stages in per_pipeline]
    done: dict[tuple, int] = {}
    order: list[GlobalAction] = []
    total = sum(len(a) for stages in per_pipeline for a in stages)
    tick = 0
    while len(order) < total:
        issued = []
        for p, stages in enumerate(per_pipeline):
            for s, acts in enumerate(stages):
                if pos[p][s] >= len(acts):
                    continue
                a = acts[pos[p][s]]
                if all(done.get(d, tick) < tick for d in _deps(p, s, a, len(stages))):
                    issued.append(GlobalAction(p, s, a.phase, a.microbatch, tick))
        if not issued:
            raise ConfigError("pipeline schedule deadlocks: no stage can make progress")
        for g in issued:
            pos[g.pipeline][g.stage] += 1
            done[(g.pipeline, g.stage, g.phase, g.microbatch)] = tick
        order += issued
        tick += 1
    return order
