"""Event simulation of a pipeline schedule: every stage owns its compute and every directed link between two stages
its transfers, so a stage computes whenever its next action's inputs are there, whatever the others do.

`simulate` replays a `ScheduleTable` with per-action durations (`ActionCosts`: per virtual stage F, B, W seconds,
or measured per-action seconds in ``measured``) and per-boundary send times; a transfer starts when its producer
ends and its link is free (first come, first served) and the consumer may start when it arrives. The same event
loop, driven by a policy that picks each stage's next action instead of reading it from a table, generates
schedules (`cfp.schedules.generate`).

Reported (`Simulation`): the makespan; each stage's busy time; the **bubble**, the fraction of the makespan during
which the busiest stage is idle (stage imbalance, which no schedule removes, is not counted); the **imbalance**,
1 - mean busy / max busy.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from cfp.errors import ConfigError
from cfp.schedules.actions import Action, Phase, ScheduleTable


@dataclass(frozen=True)
class ActionCosts:
    """Seconds per micro-batch of each virtual stage's forward (``fwd``), input gradient (``bwd_input``: B) and
    weight gradient (``bwd_weight``: W; a whole backward takes ``bwd_input + bwd_weight``), and ``send[c]``: the
    seconds to move virtual stage c's output to c + 1 (and its gradient back) when they are on different stages."""
    fwd: tuple[float, ...]
    bwd_input: tuple[float, ...]
    bwd_weight: tuple[float, ...]
    send: tuple[float, ...] = ()

    def __post_init__(self):
        for name in ("fwd", "bwd_input", "bwd_weight", "send"):
            vals = tuple(float(x) for x in getattr(self, name))
            if any(not (x >= 0.0 and x < float("inf")) for x in vals):
                raise ConfigError(f"ActionCosts.{name}={vals} must be finite and >= 0")
            object.__setattr__(self, name, vals)
        n = len(self.fwd)
        if n < 1 or len(self.bwd_input) != n or len(self.bwd_weight) != n:
            raise ConfigError(f"ActionCosts needs fwd, bwd_input and bwd_weight for each virtual stage, got "
                              f"{len(self.fwd)}, {len(self.bwd_input)}, {len(self.bwd_weight)}")
        if not self.send:
            object.__setattr__(self, "send", (0.0,) * (n - 1))
        if len(self.send) != n - 1:
            raise ConfigError(f"ActionCosts.send has {len(self.send)} entries for {n} virtual stages (needs {n - 1})")

    @property
    def num_vstages(self) -> int:
        return len(self.fwd)

    def duration(self, phase: Phase, vstage: int) -> float:
        if phase is Phase.FWD:
            return self.fwd[vstage]
        if phase is Phase.BWD_INPUT:
            return self.bwd_input[vstage]
        if phase is Phase.BWD_WEIGHT:
            return self.bwd_weight[vstage]
        return self.bwd_input[vstage] + self.bwd_weight[vstage]

    @classmethod
    def per_stage(cls, fwd: Sequence[float], bwd_input: Sequence[float], bwd_weight: Sequence[float],
                  placement: Sequence[int], send: Sequence[float] = ()) -> "ActionCosts":
        """Each stage's per-micro-batch times split evenly over its virtual stages; ``send[d]``: seconds from stage
        d to d + 1 (either way), charged where consecutive virtual stages sit on stages d and d + 1."""
        n = {d: placement.count(d) for d in set(placement)}
        pick = lambda xs: tuple(xs[d] / n[d] for d in placement)
        links = []
        for a, b in zip(placement, placement[1:]):
            links.append(0.0 if a == b or not send else send[min(a, b)])
        return cls(pick(fwd), pick(bwd_input), pick(bwd_weight), tuple(links))


@dataclass(frozen=True)
class Span:
    """One simulated action on its stage."""
    stage: int
    vstage: int
    phase: Phase
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    table: ScheduleTable
    spans: tuple[Span, ...]
    makespan: float
    busy: tuple[float, ...]        # per stage, seconds computing

    @property
    def bubble(self) -> float:
        """Fraction of the makespan during which the busiest stage is idle."""
        return 1.0 - max(self.busy) / self.makespan if self.makespan > 0 else 0.0

    @property
    def imbalance(self) -> float:
        """1 - mean busy / max busy: the idleness that uneven stages force whatever the schedule."""
        top = max(self.busy)
        return 1.0 - sum(self.busy) / (len(self.busy) * top) if top > 0 else 0.0

    def span_of(self, phase: Phase, vstage: int, microbatch: int) -> Span:
        for s in self.spans:
            if (s.phase, s.vstage, s.microbatch) == (phase, vstage, microbatch):
                return s
        raise KeyError((phase, vstage, microbatch))


Picker = Callable[[int, float, "EventState"], Optional[Action]]


class EventState:
    """What a stage's policy may read at time ``t``: when each output got where it is needed (inf: not yet)."""

    def __init__(self, placement: Sequence[int], microbatches: int):
        self.placement, self.m, self.S = tuple(placement), microbatches, len(placement)
        inf = float("inf")
        grid = lambda: [[inf] * microbatches for _ in range(self.S)]
        self.fwd_at = grid()      # [c][j]: F(c, j)'s output on the stage of c + 1
        self.grad_at = grid()     # [c][j]: c's input gradient on the stage of c - 1
        self.fwd_done = grid()
        self.bwd_done = grid()    # B (or the whole backward) of (c, j) ended

    def ready(self, a: Action, t: float) -> bool:
        return self.ready_at(a.phase, a.vstage, a.microbatch, t)

    def ready_at(self, phase: Phase, c: int, j: int, t: float) -> bool:
        if phase is Phase.FWD:
            return c == 0 or self.fwd_at[c - 1][j] <= t
        if phase is Phase.BWD_WEIGHT:
            return self.bwd_done[c][j] <= t
        return self.fwd_done[c][j] <= t and (c == self.S - 1 or self.grad_at[c + 1][j] <= t)


def run_events(placement: Sequence[int], microbatches: int, num_actions: Sequence[int], pick: Picker,
               duration: Callable[[int, Action], float], send: Sequence[float]) -> list[Span]:
    """The event loop: whenever a stage is idle, ``pick(stage, t, state)`` names an action ready at ``t`` (or None
    to wait for the next event); ``duration(stage, action)``; ``send[c]`` the boundary c -> c + 1 in seconds.
    Stops when every stage has run ``num_actions[stage]``; ConfigError when none can move (a deadlock)."""
    p = len(num_actions)
    st = EventState(placement, microbatches)
    free, ran = [0.0] * p, [0] * p
    link_free: dict[tuple[int, int], float] = {}
    heap: list = []
    seq = 0
    spans: list[Span] = []
    t = 0.0
    while True:
        for d in range(p):
            if free[d] <= t and ran[d] < num_actions[d]:
                a = pick(d, t, st)
                if a is None:
                    continue
                end = t + duration(d, a)
                spans.append(Span(d, a.vstage, a.phase, a.microbatch, t, end))
                free[d], ran[d] = end, ran[d] + 1
                heapq.heappush(heap, (end, seq, "end", d, a))
                seq += 1
        if not heap:
            if sum(ran) < sum(num_actions):
                waiting = [d for d in range(p) if ran[d] < num_actions[d]]
                raise ConfigError(f"the schedule deadlocks at t={t:.6g}: stages {waiting} wait for inputs that "
                                  "no stage will produce")
            return spans
        t = heap[0][0]
        while heap and heap[0][0] == t:
            _, _, kind, d, a = heapq.heappop(heap)
            if kind == "end":
                seq = _ended(st, placement, d, a, t, send=send, link_free=link_free, heap=heap, seq=seq)
            else:
                (st.fwd_at if a.phase is Phase.FWD else st.grad_at)[a.vstage][a.microbatch] = t


def _ended(st: EventState, placement, d: int, a: Action, t: float, *, send, link_free, heap, seq: int) -> int:
    c, j = a.vstage, a.microbatch
    if a.phase is Phase.FWD:
        st.fwd_done[c][j] = t
        dst, seconds, where = (placement[c + 1], send[c], st.fwd_at) if c + 1 < len(placement) else (None, 0, None)
    elif a.phase.sends_gradient:
        st.bwd_done[c][j] = t
        dst, seconds, where = (placement[c - 1], send[c - 1], st.grad_at) if c > 0 else (None, 0, None)
    else:
        return seq
    if dst is None:
        return seq
    if dst == d or seconds == 0:
        where[c][j] = t
        return seq
    start = max(t, link_free.get((d, dst), 0.0))
    link_free[(d, dst)] = start + seconds
    heapq.heappush(heap, (start + seconds, seq, "arrive", dst, a))
    return seq + 1


def simulate(table: ScheduleTable, costs: ActionCosts,
             measured: Optional[Mapping[tuple[Phase, int, int], float]] = None) -> Simulation:
    """Replay ``table``'s per-stage orders: each action takes ``measured[(phase, vstage, microbatch)]`` seconds
    where given, else ``costs``'; a stage runs its next action as soon as it is free and the action's inputs have
    arrived. ConfigError when the orders deadlock."""
    if costs.num_vstages != table.num_vstages:
        raise ConfigError(f"costs for {costs.num_vstages} virtual stages, table {table.name} has "
                          f"{table.num_vstages}")
    pos = [0] * table.num_stages

    def pick(d: int, t: float, st: EventState) -> Optional[Action]:
        a = table[d][pos[d]]
        if not st.ready(a, t):
            return None
        pos[d] += 1
        return a

    def duration(d: int, a: Action) -> float:
        if measured is not None and (a.phase, a.vstage, a.microbatch) in measured:
            return float(measured[(a.phase, a.vstage, a.microbatch)])
        return costs.duration(a.phase, a.vstage)

    spans = run_events(table.placement, table.microbatches, [len(a) for a in table], pick, duration, costs.send)
    return finish(table, spans)


def finish(table: ScheduleTable, spans: Sequence[Span]) -> Simulation:
    """The `Simulation` of simulated spans (makespan from the first start to the last end)."""
    busy = [0.0] * table.num_stages
    for s in spans:
        busy[s.stage] += s.end - s.start
    t0 = min((s.start for s in spans), default=0.0)
    span = max((s.end for s in spans), default=0.0) - t0
    return Simulation(table, tuple(spans), span, tuple(busy))
