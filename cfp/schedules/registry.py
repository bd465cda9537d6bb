"""Pipeline schedules as data: the registry (`SCHEDULES`), their fixed patterns and their generated forms.

A schedule (`ScheduleSpec`: a `ScheduleName` and ``v``, the virtual stages per stage) gives, for ``p`` stages and
``m`` micro-batches, a `ScheduleTable` (`cfp.schedules.actions`): every stage's ordered actions over virtual
stages placed on the stages. Its `Schedule` entry says how it places virtual stages (`Placement`), whether its
backward runs as B (input gradient) and W (weight gradient), how much each stage keeps in its fixed pattern (the
table it runs with equal stage times: GPipe, 1F1B, interleaved 1F1B and ZB-H1 written out; ZB-V generated from
equal times), and its time (`cfp.schedules.formulas`).

``Schedule.generated`` builds the table from each virtual stage's F, B and W times under a per-stage memory limit
(`cfp.schedules.generate`): of the fixed pattern and the generator's tables, the shortest by the event
simulation (`cfp.schedules.simulate`) with those times, so a slow stage does not idle the fast ones. Every table is
validated (`check_table`) before it is handed on. ``global_order`` merges pipelines' tables into the order the
executor dispatches (every process of a multi-process run walks the same order).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from cfp.errors import ConfigError
from cfp.schedules import formulas
from cfp.schedules.actions import (Action, GlobalAction, KeptBytes, Phase, Placement, ScheduleTable,
                                   StageActions, check_table, global_order, kept_profile, linear_table,
                                   peak_kept)
from cfp.schedules.formulas import pipeline_time
from cfp.schedules.generate import generate
from cfp.schedules.simulate import ActionCosts, Simulation, simulate

__all__ = ["Action", "GlobalAction", "Phase", "Placement", "ScheduleTable", "StageActions", "check_table",
           "global_order", "pipeline_time", "ScheduleName", "ScheduleSpec", "Schedule", "SCHEDULES", "gpipe",
           "one_f_one_b", "interleaved", "zb_h1", "check_schedule"]


class ScheduleName(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_V = "zb-v"

    @classmethod
    def parse(cls, name: "str | ScheduleName") -> "ScheduleName":
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"unknown schedule {name!r}; valid choices: "
                              f"{', '.join(s.value for s in cls)}") from None


# ----------------------------------------------------------------------------- fixed patterns
def gpipe(num_stages: int, num_microbatches: int) -> StageActions:
    """All forwards, then all backwards (backwards in micro-batch order)."""
    return [[Action(Phase.FWD, m, s) for m in range(num_microbatches)]
            + [Action(Phase.BWD, m, s) for m in range(num_microbatches)]
            for s in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> StageActions:
    """Non-interleaved 1F1B (PipeDream-flush): warm-up forwards, alternate, drain backwards."""
    out = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, num_microbatches)
        acts = [Action(Phase.FWD, m, s) for m in range(warm)]
        for i in range(num_microbatches - warm):
            acts += [Action(Phase.FWD, warm + i, s), Action(Phase.BWD, i, s)]
        acts += [Action(Phase.BWD, m, s) for m in range(num_microbatches - warm, num_microbatches)]
        out.append(acts)
    return out


def interleaved(num_stages: int, num_microbatches: int, v: int) -> StageActions:
    """Interleaved 1F1B (Megatron-LM): virtual stage c on stage c mod p; each stage runs its virtual stages' forwards
    in rounds of p micro-batches, one virtual stage after the other (backwards the same with the virtual stages
    reversed), after ``2(p - s - 1) + (v - 1)p`` warm-up forwards on stage s alternates forward and backward."""
    p, m = num_stages, num_microbatches

    def rounds(s: int, reverse: bool) -> list[tuple[int, int]]:
        seq = []
        for g in range(0, m, p):
            for k in (reversed(range(v)) if reverse else range(v)):
                seq += [(k * p + s, j) for j in range(g, min(g + p, m))]
        return seq

    out = []
    for s in range(p):
        fwd, bwd = rounds(s, False), rounds(s, True)
        warm = min(2 * (p - s - 1) + (v - 1) * p, len(fwd))
        acts = [Action(Phase.FWD, j, c) for c, j in fwd[:warm]]
        for (cf, jf), (cb, jb) in zip(fwd[warm:], bwd):
            acts += [Action(Phase.FWD, jf, cf), Action(Phase.BWD, jb, cb)]
        acts += [Action(Phase.BWD, j, c) for c, j in bwd[len(fwd) - warm:]]
        out.append(acts)
    return out


def zb_h1(num_stages: int, num_microbatches: int) -> StageActions:
    """ZB-H1: 1F1B with each backward split into B and W, stage s deferring its Ws by s micro-batches (so every
    stage keeps at most p micro-batches, 1F1B's most) -- the deferred Ws fill what 1F1B leaves idle."""
    out = []
    for s, acts in enumerate(one_f_one_b(num_stages, num_microbatches)):
        row, waiting = [], []
        for a in acts:
            if a.phase is Phase.FWD:
                row.append(a)
                continue
            row.append(Action(Phase.BWD_INPUT, a.microbatch, s))
            waiting.append(a.microbatch)
            if a.microbatch >= s:
                row.append(Action(Phase.BWD_WEIGHT, waiting.pop(0), s))
        out.append(row + [Action(Phase.BWD_WEIGHT, j, s) for j in waiting])
    return out


# ----------------------------------------------------------------------------- specs and entries
@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule and its virtual stages per stage ``v`` (interleaved: any v >= 2, default 2; ZB-V: 2; others 1).
    Text form: ``name`` or ``interleaved:V``."""
    name: ScheduleName
    v: int = 0

    def __post_init__(self):
        name = ScheduleName.parse(self.name)
        object.__setattr__(self, "name", name)
        entry = SCHEDULES[name]
        v = self.v or entry.default_v
        if isinstance(v, bool) or not isinstance(v, int) or not entry.allows_v(v):
            raise ConfigError(f"schedule {name.value}: v={self.v!r} virtual stages per stage is invalid "
                              f"({entry.v_rule})")
        object.__setattr__(self, "v", v)

    @classmethod
    def parse(cls, text: "str | ScheduleName | ScheduleSpec") -> "ScheduleSpec":
        if isinstance(text, ScheduleSpec):
            return text
        if isinstance(text, ScheduleName):
            return cls(text)
        name, sep, v = str(text).partition(":")
        if not sep:
            return cls(ScheduleName.parse(name))
        try:
            vv = int(v)
        except ValueError:
            raise ConfigError(f"schedule {text!r}: {v!r} after ':' is not a number of virtual stages") from None
        return cls(ScheduleName.parse(name), vv)

    @property
    def entry(self) -> "Schedule":
        return SCHEDULES[self.name]

    def __str__(self) -> str:
        return f"{self.name.value}:{self.v}" if self.name is ScheduleName.INTERLEAVED else self.name.value


def _counts_gpipe(s: int, p: int, m: int, v: int) -> tuple[int, int]:
    return m, 0


def _counts_1f1b(s: int, p: int, m: int, v: int) -> tuple[int, int]:
    return min(m, p - s), 0


def _counts_interleaved(s: int, p: int, m: int, v: int) -> tuple[int, int]:
    return min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1), 0


def _counts_zb_h1(s: int, p: int, m: int, v: int) -> tuple[int, int]:
    return min(m, p - s), min(m, s + 1)


def _counts_zb_v(s: int, p: int, m: int, v: int) -> tuple[int, int]:
    return 2 * min(m, p), 2 * min(m, p)


@dataclass(frozen=True)
class Schedule:
    """One schedule as data. ``fixed(p, m, v)``: its written-out pattern (None: generated from equal times);
    ``counts(stage, p, m, v)``: the most virtual-stage inputs (kept from F to the backward) and W stashes (kept
    from B to W) its pattern keeps on a stage at once (closed form; the planner prices memory by it);
    ``seconds``: its time formula (`cfp.schedules.formulas`); ``runs_on_engine``: whether the runtime's stage
    programs run it; ``adapts``: its pattern is one of many valid orders (not the schedule's definition, as GPipe's
    and 1F1B's are), so a run may replace it by a table generated from measured times."""
    name: ScheduleName
    placement: Placement
    split: bool
    fixed: Callable[[int, int, int], Optional[StageActions]]
    counts: Callable[[int, int, int, int], tuple[int, int]]
    seconds: Callable[..., float]
    default_v: int = 1
    runs_on_engine: bool = False
    adapts: bool = False

    def allows_v(self, v: int) -> bool:
        if self.placement is Placement.LOOP:
            return v >= 2
        return v == (2 if self.placement is Placement.V else 1)

    @property
    def v_rule(self) -> str:
        return {Placement.LOOP: "interleaved needs v >= 2", Placement.V: "ZB-V holds exactly 2",
                Placement.LINEAR: "it holds exactly 1"}[self.placement]

    def head_stage(self, num_stages: int, v: Optional[int] = None) -> int:
        """The stage of the last virtual stage (the model's head and loss): stage 0 for ZB-V."""
        return self.placement.stages(num_stages, v or self.default_v)[-1]

    def pattern(self, num_stages: int, microbatches: int, v: Optional[int] = None) -> ScheduleTable:
        """The fixed pattern (validated, within `unit_limit`): written out, or generated from equal F, B and W
        times under `unit_limit`."""
        return _pattern(self.name, num_stages, microbatches, v or self.default_v)

    def unit_limit(self, num_stages: int, microbatches: int, v: Optional[int] = None) -> tuple[float, ...]:
        """Per stage, what its pattern keeps at most, one unit per micro-batch of a whole stage (1/v per virtual
        stage) from its forward to its W (or whole backward): the written-out pattern's peak, else 1F1B's most
        (the first stage's min(p, m)) for ZB-V and Megatron's warm-up for interleaved."""
        return _unit_limit(self.name, num_stages, microbatches, v or self.default_v)

    def generated(self, num_stages: int, microbatches: int, costs: ActionCosts, v: Optional[int] = None,
                  limit: Optional[Sequence[float]] = None, kept: Optional[KeptBytes] = None
                  ) -> tuple[ScheduleTable, Simulation]:
        """The table for ``costs`` (per virtual stage F, B, W and send seconds) under ``limit`` (per stage, in the
        units of ``kept``; default: `unit_limit`) and its simulation: the shortest, simulated with ``costs``, of
        the fixed pattern (where it keeps within the limit) and the generator's tables. Validated."""
        v = v or self.default_v
        placement = self.placement.stages(num_stages, v)
        kept = kept or KeptBytes((1.0 / v,) * len(placement), (1.0 / v,) * len(placement))
        limit = tuple(limit) if limit is not None else self.unit_limit(num_stages, microbatches, v)
        table, sim = generate(self.name.value, placement, microbatches, costs, self.split, limit, kept,
                              [self.pattern(num_stages, microbatches, v)])
        check_table(table, limit, kept)
        return table, sim

    def __call__(self, num_stages: int, num_microbatches: int, v: Optional[int] = None) -> ScheduleTable:
        """The table the runtime runs: the fixed pattern (with ``v`` virtual stages per stage; the runtime runs
        them as stages of their own, `cfp.runtime.vstages`). ConfigError for a schedule the runtime does not run."""
        if not self.runs_on_engine:
            runs = ", ".join(n.value for n, s in SCHEDULES.items() if s.runs_on_engine)
            raise ConfigError(f"schedule {self.name.value} is priced, generated and simulated, but the runtime "
                              f"does not run it (it runs {runs})")
        v = v or self.default_v
        if num_microbatches == 0 and num_stages >= 1:   # a step whose dispatch gave this pipeline nothing
            return ScheduleTable(self.name.value, self.placement.stages(num_stages, v), 0,
                                 tuple(() for _ in range(num_stages)))
        return self.pattern(num_stages, num_microbatches, v)

    def equal_bubble(self, num_stages: int, microbatches: int, v: Optional[int] = None) -> float:
        """The bubble of its time formula with equal stages whose F, B and W take the same time (GPipe and 1F1B:
        (p - 1) / (m + p - 1))."""
        t = self.theory(num_stages, microbatches, 1.0, 1.0, 1.0, v)
        return formulas.bubble_of(t, microbatches, 3.0)

    def theory(self, num_stages: int, microbatches: int, fwd: float, bwd_input: float, bwd_weight: float,
               v: Optional[int] = None) -> float:
        """The pass's seconds with ``num_stages`` equal stages (`cfp.schedules.formulas`)."""
        return formulas.theory(self.seconds, num_stages, microbatches, v or self.default_v,
                                    fwd, bwd_input, bwd_weight)


@functools.lru_cache(maxsize=512)
def _fixed_table(name: ScheduleName, p: int, m: int, v: int) -> Optional[ScheduleTable]:
    if p < 1 or m < 1:
        raise ConfigError(f"a pipeline schedule needs >= 1 stage and >= 1 micro-batch, got {p} and {m}")
    entry = SCHEDULES[name]
    acts = entry.fixed(p, m, v)
    return None if acts is None else ScheduleTable(name.value, entry.placement.stages(p, v), m,
                                                     tuple(tuple(a) for a in acts))


@functools.lru_cache(maxsize=512)
def _unit_limit(name: ScheduleName, p: int, m: int, v: int) -> tuple[float, ...]:
    fixed = _fixed_table(name, p, m, v)
    if fixed is not None:
        return tuple(peak_kept(fixed, KeptBytes.units(fixed)))
    if name is ScheduleName.ZB_V:
        return (float(min(p, m)),) * p
    return tuple(_counts_interleaved(s, p, m, v)[0] / v for s in range(p))


@functools.lru_cache(maxsize=512)
def _pattern(name: ScheduleName, p: int, m: int, v: int) -> ScheduleTable:
    entry = SCHEDULES[name]
    table = _fixed_table(name, p, m, v)
    limit = _unit_limit(name, p, m, v)
    if table is None:
        placement = entry.placement.stages(p, v)
        ones = ActionCosts.per_stage([1.0] * p, [1.0] * p, [1.0] * p, placement)
        table, _ = generate(name.value, placement, m, ones, entry.split, limit)
    check_table(table, limit)
    return table


SCHEDULES: dict[ScheduleName, Schedule] = {
    ScheduleName.GPIPE: Schedule(ScheduleName.GPIPE, Placement.LINEAR, False, lambda p, m, v: gpipe(p, m),
                                 _counts_gpipe, formulas.one_f_one_b_seconds, runs_on_engine=True),
    ScheduleName.ONE_F_ONE_B: Schedule(ScheduleName.ONE_F_ONE_B, Placement.LINEAR, False,
                                       lambda p, m, v: one_f_one_b(p, m), _counts_1f1b,
                                       formulas.one_f_one_b_seconds, runs_on_engine=True),
    ScheduleName.INTERLEAVED: Schedule(ScheduleName.INTERLEAVED, Placement.LOOP, False,
                                       lambda p, m, v: interleaved(p, m, v) if m % p == 0 else None,
                                       _counts_interleaved, formulas.interleaved_seconds, default_v=2,
                                       runs_on_engine=True, adapts=True),
    ScheduleName.ZB_H1: Schedule(ScheduleName.ZB_H1, Placement.LINEAR, True, lambda p, m, v: zb_h1(p, m),
                                 _counts_zb_h1, formulas.zb_h1_seconds, runs_on_engine=True, adapts=True),
    ScheduleName.ZB_V: Schedule(ScheduleName.ZB_V, Placement.V, True, lambda p, m, v: None, _counts_zb_v,
                                formulas.zb_v_seconds, default_v=2, runs_on_engine=True, adapts=True),
}


def check_schedule(actions: "ScheduleTable | StageActions", num_microbatches: int) -> None:
    """Every stage runs each micro-batch's forward and backward exactly once, in an order that does not deadlock
    (`check_table`)."""
    table = actions if isinstance(actions, ScheduleTable) else linear_table("custom", actions, num_microbatches)
    if table.microbatches != num_microbatches:
        raise ConfigError(f"schedule {table.name} is for {table.microbatches} micro-batches, not {num_microbatches}")
    check_table(table)


AUTO = "auto"
AUTO_SCHEDULES = ("1f1b", "interleaved:2", "zb-h1", "zb-v")   # what `auto` chooses from; 1F1B (the leanest) first


def schedule_choices(value) -> tuple[ScheduleSpec, ...]:
    """The schedules a pipeline may run: ``"auto"`` (`AUTO_SCHEDULES`), one schedule (a `ScheduleName`,
    `ScheduleSpec` or its text), or a sequence of them; the first is the base the planner sizes stages by."""
    if isinstance(value, str) and value == AUTO:
        value = AUTO_SCHEDULES
    if isinstance(value, (str, ScheduleName, ScheduleSpec)):
        return (ScheduleSpec.parse(value),)
    try:
        out = tuple(ScheduleSpec.parse(v) for v in value)
    except TypeError:
        raise ConfigError(f"schedule={value!r} is not a schedule, a list of them or {AUTO!r}") from None
    if not out:
        raise ConfigError("an empty list of schedules")
    return tuple(dict.fromkeys(out))
