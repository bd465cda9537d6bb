"""Pipeline timelines: per-(pipeline, stage, micro-batch) forward/backward intervals, bubble statistics, plots.

Every event is a measured interval of positive length (zero-length or reversed ones are refused), and a
measured bubble below the schedule's minimum is flagged INVALID (`Timeline.check` raises): below
(p-1)/(m+p-1) with equal action times, or in general below what the measured action times allow (the makespan
cannot be shorter than the schedule's critical path through them).

Times are whatever clock the caller uses (seconds from `time.perf_counter` by default in :meth:`Timeline.span`).
JAX dispatches asynchronously, so to measure a stage's compute, block on its outputs
(`jax.block_until_ready`) before taking the end time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Optional

from cfp.errors import ConfigError
from cfp.files import write_json_atomic
from cfp.schedules.registry import Phase


_COLORS = {Phase.FWD: "#4C72B0", Phase.BWD: "#DD8452", Phase.BWD_INPUT: "#C44E52", Phase.BWD_WEIGHT: "#55A868"}


def _phase(phase) -> Phase:
    try:
        return Phase(phase)
    except ValueError:
        raise ConfigError(f"phase={phase!r} is invalid (choose from {[p.value for p in Phase]})") from None


@dataclasses.dataclass(frozen=True)
class Event:
    pipeline: int
    stage: int
    microbatch: int
    phase: Phase
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def theoretical_bubble(num_stages: int, num_microbatches: int) -> float:
    """GPipe / 1F1B bubble fraction with equal stage times: (p - 1) / (m + p - 1)."""
    if num_stages < 1 or num_microbatches < 1:
        raise ConfigError(f"num_stages={num_stages}, num_microbatches={num_microbatches} are invalid "
                          "(both must be >= 1)")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class MeasurementError(ConfigError):
    """Timings that cannot be true (a bubble below the schedule's minimum): a bug in how they were taken."""


def critical_path(events: list[Event]) -> float:
    """The shortest makespan one pipeline's actions could have with their measured durations: the longest path
    through the schedule's dependencies (a forward after the previous stage's forward of its micro-batch, a
    backward or B after the next stage's backward or B and its own forward, a W after its B, and each stage's
    actions in turn). `inf`
    when the events contradict the schedule (a cycle: a stage ran an action before one it depends on)."""
    by_key = {(e.stage, e.microbatch, e.phase): e for e in events}
    deps: dict = {k: [] for k in by_key}
    for st in {e.stage for e in events}:
        turn = sorted((e for e in events if e.stage == st), key=lambda e: (e.start, e.end))
        for a, b in zip(turn, turn[1:]):
            deps[(b.stage, b.microbatch, b.phase)].append((a.stage, a.microbatch, a.phase))
    for (st, mb, ph) in by_key:
        want = ([(st - 1, mb, Phase.FWD)] if ph is Phase.FWD else [(st, mb, Phase.BWD_INPUT)]
                if ph is Phase.BWD_WEIGHT else [(st + 1, mb, ph), (st, mb, Phase.FWD)])
        deps[(st, mb, ph)] += [d for d in want if d in by_key]
    finish: dict = {}
    for k in sorted(by_key, key=lambda k: (by_key[k].start, by_key[k].end)):
        stack = [k]
        while stack:                     # iterative depth-first longest path (no recursion limit)
            top = stack[-1]
            todo = [d for d in deps[top] if d not in finish]
            if any(d in stack for d in todo):
                return float("inf")
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            e = by_key[top]
            finish[top] = e.duration + max((finish[d] for d in deps[top]), default=0.0)
    return max(finish.values(), default=0.0)


def replay_measured(events: list[Event], table) -> "Simulation":
    """One pipeline's measured actions replayed in the event simulation (`cfp.schedules.simulate`) of the table it
    ran (an event's stage is its virtual stage): each action takes its measured duration, every stage owns its
    compute (its virtual stages run one at a time), so the makespan and bubble are those of devices that do not
    share cores (on a shared host an idle device gives its cores to the others and wall time hides the bubble)."""
    from cfp.schedules.simulate import ActionCosts, simulate
    measured = {(e.phase, e.stage, e.microbatch): e.duration for e in events}
    zeros = (0.0,) * table.num_vstages
    return simulate(table, ActionCosts(zeros, zeros, zeros), measured)


def median_action_seconds(events: list[Event], num_stages: int) -> tuple[list[float], list[float], list[float]]:
    """Per stage (of the events: virtual stages where the schedule has them), the median measured seconds of its F, B (a whole backward counts here) and W: robust to the
    stalls a shared host puts into a few actions."""
    out = []
    for phases in ((Phase.FWD,), (Phase.BWD_INPUT, Phase.BWD), (Phase.BWD_WEIGHT,)):
        row = []
        for st in range(num_stages):
            d = [e.duration for e in events if e.stage == st and e.phase in phases]
            row.append(statistics.median(d) if d else 0.0)
        out.append(row)
    return out[0], out[1], out[2]


def bubble_line(pipeline: int, v: dict) -> str:
    """One line per pipeline: the measured bubble next to the theoretical one; INVALID when below the minimum
    that its own measured action times allow (only a measuring bug gives that)."""
    line = (f"pipeline {pipeline}: bubble measured {v['bubble']:.1%} vs theoretical {v['theoretical_bubble']:.1%} "
            f"(p={v['stages']}, m={v['microbatches']})")
    if not v["valid"]:
        line += (f" INVALID: below the minimum its measured action times allow ({v['minimum_bubble']:.1%}), so the "
                 f"timings are wrong (a measuring bug)")
    elif v["bubble"] < v["theoretical_bubble"] - 1e-9:
        line += (f"; below the equal-time figure because the measured action times vary (they allow "
                 f"{v['minimum_bubble']:.1%})")
    return line


def _union_length_per_stage(events: list[Event]) -> float:
    """The summed busy time of the events' stages (each stage's intervals' union)."""
    per: dict[int, list] = {}
    for e in events:
        per.setdefault(e.stage, []).append((e.start, e.end))
    return sum(_union_length(v) for v in per.values())


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    # overlapping events on one stage (e.g. async overlap) count once: busy is wall time, not summed work
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class Timeline:
    """A list of :class:`Event`; `record` from the engine, then `bubble_fraction`, `save_json`, `plot_png`.

    ``unmeasured``: how many of the step's actions have no event (a busy host can miss when one starts). Such a
    timeline still saves and plots what was measured, but has no bubble: busy time would be undercounted."""

    def __init__(self, events: Iterable[Event] = (), clock=time.perf_counter, unmeasured: int = 0):
        if isinstance(unmeasured, bool) or not isinstance(unmeasured, int) or unmeasured < 0:
            raise ConfigError(f"unmeasured={unmeasured!r} is invalid (a count of actions, >= 0)")
        self._events: list[Event] = list(events)
        self.clock = clock
        self.unmeasured = unmeasured

    @property
    def events(self) -> list[Event]:
        return list(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def record(self, pipeline: int, stage: int, microbatch: int, phase: Phase | str,
               start: float, end: float) -> Event:
        """Add a measured event; one ending before or when it starts cannot be a measurement and is refused."""
        if not end > start:
            what = "before" if end < start else "at"
            raise ConfigError(f"event end={end} is {what} start={start} (pipeline {pipeline}, stage {stage}, "
                              f"micro-batch {microbatch}): a zero-length or reversed event is not a measurement")
        ev = Event(int(pipeline), int(stage), int(microbatch), _phase(phase), float(start), float(end))
        self._events.append(ev)
        return ev

    @contextlib.contextmanager
    def span(self, pipeline: int, stage: int, microbatch: int, phase: Phase | str):
        """Record the wall time of the `with` body (block on JAX outputs inside it)."""
        start = self.clock()
        yield
        self.record(pipeline, stage, microbatch, phase, start, self.clock())

    def pipelines(self) -> list[int]:
        return sorted({e.pipeline for e in self._events})

    def _of(self, pipeline: int) -> list[Event]:
        evs = [e for e in self._events if e.pipeline == pipeline]
        if not evs:
            raise ConfigError(f"pipeline {pipeline} has no events (pipelines: {self.pipelines()})")
        return evs

    def stages(self, pipeline: int) -> list[int]:
        return sorted({e.stage for e in self._of(pipeline)})

    def num_microbatches(self, pipeline: int) -> int:
        return len({e.microbatch for e in self._of(pipeline)})

    def makespan(self, pipeline: int) -> float:
        evs = self._of(pipeline)
        return max(e.end for e in evs) - min(e.start for e in evs)

    def busy_time(self, pipeline: int | None = None) -> dict[tuple[int, int], float]:
        """{(pipeline, stage): time the stage was computing}, for one pipeline or all."""
        out: dict[tuple[int, int], list] = {}
        for e in self._events:
            if pipeline is None or e.pipeline == pipeline:
                out.setdefault((e.pipeline, e.stage), []).append((e.start, e.end))
        return {k: _union_length(v) for k, v in sorted(out.items())}

    def bubble_fraction(self, pipeline: int = 0, num_stages: int | None = None) -> float:
        """1 - busy / (num_stages * makespan); num_stages defaults to the stages that recorded events."""
        p = num_stages if num_stages is not None else len(self.stages(pipeline))
        span = self.makespan(pipeline)
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy_time(pipeline).values()) / (p * span)

    def summary(self, placements: Optional[Sequence[Sequence[int]]] = None) -> dict[int, dict[str, float]]:
        """Per pipeline: stages, micro-batches, makespan, the measured bubble, the theoretical one with equal
        action times, (p-1)/(m+p-1), and `minimum_bubble`, the least these measured action times allow (the
        makespan of the schedule's critical path; equal to the theoretical one when the times are equal).
        `valid` is False when the measured bubble is below that minimum, which only a measuring bug gives.
        ``placements[q][c]``: the stage running pipeline q's virtual stage c, where events name virtual stages
        (interleaved, ZB-V): busy time and bubble are then per stage (its virtual stages' devices)."""
        if self.unmeasured:
            raise ConfigError(f"no bubble: {self.unmeasured} actions of the step were not measured, so the "
                              "stages' busy time is unknown")
        out = {}
        for q in self.pipelines():
            evs, m = self._of(q), self.num_microbatches(q)
            if placements is not None:
                evs = [dataclasses.replace(e, stage=placements[q][e.stage]) for e in evs]
            p, span = len({e.stage for e in evs}), self.makespan(q)
            busy = _union_length_per_stage(evs)
            path = critical_path(self._of(q))    # by virtual stage: a lower bound when stages hold several
            least = 1.0 - busy / (p * path) if 0 < path < float("inf") else float("inf")
            bubble = 1.0 - busy / (p * span) if span > 0 else 0.0
            out[q] = {"stages": p, "microbatches": m, "makespan": span, "bubble": bubble,
                      "theoretical_bubble": theoretical_bubble(p, m), "minimum_bubble": least,
                      "valid": span >= path * (1 - 1e-9)}
        return out

    def check(self) -> None:
        """Raise `MeasurementError` when a pipeline's measured bubble is below the minimum its times allow."""
        for q, v in self.summary().items():
            if not v["valid"]:
                raise MeasurementError(bubble_line(q, v))

    # ---- persistence ----
    def to_dict(self) -> dict:
        return {"version": 1, "unmeasured": self.unmeasured,
                "events": [dict(dataclasses.asdict(e), phase=e.phase.value) for e in self._events]}

    def save_json(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.to_dict(), indent=None)


    # ---- plot ----
    def plot_png(self, path: str | os.PathLike, title: str | None = None,
                 placements: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Gantt chart: one row per (pipeline, stage), a bar per micro-batch coloured by phase; with
        ``placements`` (as `summary`'s) one row per virtual stage, named with its stage."""
        if not self._events:
            raise ConfigError("timeline has no events to plot")
        import matplotlib

        matplotlib.use("Agg")  # headless; no display needed
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        t0 = min(e.start for e in self._events)
        span = max(e.end for e in self._events) - t0
        scale, unit = (1e3, "ms") if span < 1.0 else (1.0, "s")
        rows = sorted({(e.pipeline, e.stage) for e in self._events})
        row_of = {r: i for i, r in enumerate(rows)}
        fig, ax = plt.subplots(figsize=(12, 1.6 + 0.45 * len(rows)))
        for e in self._events:
            y = row_of[(e.pipeline, e.stage)]
            x, w = (e.start - t0) * scale, e.duration * scale
            ax.barh(y, w, left=x, height=0.8, color=_COLORS[e.phase], edgecolor="white", linewidth=0.6)
            if w > 0.025 * span * scale:  # label only bars wide enough to hold the text
                ax.text(x + w / 2, y, str(e.microbatch), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(rows)), [f"pipe {q} / stage {s}" if placements is None else
                                         f"pipe {q} / stage {placements[q][s]} (virtual {s})" for q, s in rows])
        for i in range(1, len(rows)):  # separate pipelines
            if rows[i][0] != rows[i - 1][0]:
                ax.axhline(i - 0.5, color="grey", linewidth=0.8, linestyle="--")
        ax.invert_yaxis()  # stage 0 on top, like the usual pipeline diagrams
        ax.set_xlabel(f"time ({unit})")
        ax.set_xlim(0, span * scale)
        stats = self._stats_line(placements)
        ax.set_title(f"{title}\n{stats}" if title else stats, fontsize=9)
        ax.legend(handles=[Patch(color=_COLORS[p], label=p.value) for p in Phase], loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def _stats_line(self, placements: Optional[Sequence[Sequence[int]]] = None) -> str:
        if self.unmeasured:
            return f"bubble not measured: {self.unmeasured} actions of the step were not measured (not drawn)"
        sep = "; " if len(self.pipelines()) <= 2 else "\n"
        return sep.join(f"pipe {q}: bubble {v['bubble']:.1%}{'' if v['valid'] else ' INVALID'} "
                        f"(theory {v['theoretical_bubble']:.1%}, p={v['stages']}, m={v['microbatches']})"
                        for q, v in self.summary(placements).items())
