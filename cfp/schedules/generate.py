"""Schedules generated from each virtual stage's F, B and W times under a per-stage memory limit.

The generator runs the event simulation (`cfp.schedules.simulate.run_events`) with a policy in place of a table:
whenever a stage is idle it runs one of the actions whose inputs have arrived --

* a backward (B, or the whole backward): the oldest micro-batch's, the later virtual stage first (it is on the
  critical path and frees memory);
* a forward, the later virtual stage first (a micro-batch in flight before a new one), if memory admits it;
* a deferred W (the oldest), which fills what would otherwise be idle time --

and otherwise waits for the next arrival, recording each stage's picks as its order. So a fast stage next to a
slow one fills its waiting with deferred Ws, and with forwards as far as memory allows, where a fixed pattern
leaves the slots it planned for equal times. Which of backward and forward goes first, and how memory admits a
forward, are the policy's knobs (`Policy`); `generate` runs every policy of a small fixed set, plus the given
seed tables (a fixed pattern) replayed, keeps the shortest by simulated makespan (ties: the first), so the
result is never longer than the pattern under the same times, and then `improve`s it: swaps of two neighbouring
actions of a stage, kept where the table stays valid, within memory, and gets shorter.

Memory: a stage keeps what its micro-batches keep (`KeptBytes`): ``inputs`` from a forward to its B (or whole
backward), ``weight`` from a B to its W. A B runs only if what it adds (``weight - inputs``) fits, else the
stage's Ws run first; a forward only if it leaves free, beyond its own input, room for one B to grow and for
what other micro-batches in flight still bring to the stage's later virtual stages (*spare*: the most any one of
them brings, except for the pipeline's oldest unfinished micro-batch; or *pinned*: a micro-batch's first forward
on a stage reserves its later virtual stages' inputs there at once). So a ready B always fits once its stage's
Ws have run and the oldest unfinished micro-batch can always move: the generator cannot deadlock once a stage's
limit holds one micro-batch's inputs and one B's growth, and a generated table keeps within its limits
(`check_table` checks it again).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from cfp.errors import ConfigError
from cfp.schedules.actions import Action, KeptBytes, Phase, ScheduleTable, kept_change, peak_kept
from cfp.schedules.simulate import ActionCosts, EventState, Simulation, finish, run_events, simulate


@dataclass(frozen=True)
class Policy:
    """``alternate``: after a forward a backward goes first and after a backward a forward (1F1B's rhythm);
    otherwise backwards always go first. ``pinned``: memory admission charges a micro-batch's virtual stages on a
    stage at its first forward there (else *spare*, module docstring). ``eager_w``: with that many Ws waiting, a
    stage runs them before any new forward (0: never)."""
    alternate: bool
    pinned: bool
    eager_w: int = 0


def policies(num_stages: int) -> tuple[Policy, ...]:
    """The policies `generate` tries."""
    return tuple(Policy(a, pin, w) for a in (False, True) for pin in (False, True)
                 for w in sorted({0, 2, num_stages}))


class _Greedy:
    """One policy's picks (module docstring); ``order`` holds each stage's."""

    def __init__(self, placement: Sequence[int], m: int, split: bool, kept: KeptBytes, limit: Sequence[float],
                 policy: Policy):
        self.m, self.split, self.policy = m, split, policy
        self.S = len(placement)
        p = max(placement) + 1
        self.mine = [sorted((c for c in range(self.S) if placement[c] == d), reverse=True) for d in range(p)]
        self.inputs = tuple(kept.inputs)
        self.grow = tuple(max(0.0, w - i) for i, w in zip(kept.inputs, kept.weight)) if split else (0.0,) * self.S
        self.weight = tuple(kept.weight)
        # room kept free on a stage so that a ready B always fits once its stage's Ws have run
        self.reserve = [max(self.grow[c] for c in self.mine[d]) for d in range(p)]
        self.limit = tuple(x * (1 + 1e-9) for x in limit)
        for d in range(p):
            need = sum(self.inputs[c] for c in self.mine[d]) + self.reserve[d]
            if need > self.limit[d]:
                raise ConfigError(f"stage {d}'s memory limit {limit[d]:.4g} is below what one micro-batch keeps "
                                  f"there ({need:.4g}): no schedule fits")
        self.next_f, self.next_b = [0] * self.S, [0] * self.S
        self.pending_w: list[deque] = [deque() for _ in range(p)]
        self.kept = [0.0] * p           # what each stage keeps now
        self.pinned = [0.0] * p         # inputs pinned micro-batches will still bring (pinned admission)
        self.need: list[dict[int, float]] = [{} for _ in range(p)]    # micro-batch -> inputs still to come
        self.remaining = [self.S * (3 if split else 2)] * m
        self.oldest = 0
        self.order: list[list[Action]] = [[] for _ in range(p)]
        self.back = Phase.BWD_INPUT if split else Phase.BWD
        self.last_fwd = [False] * p

    def __call__(self, d: int, t: float, st: EventState) -> Optional[Action]:
        pol = self.policy
        if pol.eager_w and len(self.pending_w[d]) >= pol.eager_w:
            a = self._backward(d, t, st) or self._weight(d)
        elif pol.alternate and not self.last_fwd[d]:
            a = self._forward(d, t, st) or self._backward(d, t, st) or self._weight(d)
        else:
            a = self._backward(d, t, st) or self._forward(d, t, st) or self._weight(d)
        if a is not None:
            self._ran(d, a)
        return a

    def _ran(self, d: int, a: Action) -> None:
        self.order[d].append(a)
        if a.phase is not Phase.BWD_WEIGHT:
            self.last_fwd[d] = a.phase is Phase.FWD
        j, c = a.microbatch, a.vstage
        self.remaining[j] -= 1
        while self.oldest < self.m and not self.remaining[self.oldest]:
            self.oldest += 1
        if a.phase is Phase.BWD_INPUT:
            self.kept[d] += self.weight[c] - self.inputs[c]
        elif a.phase is Phase.BWD_WEIGHT:
            self.kept[d] -= self.weight[c]
        elif a.phase is Phase.BWD:
            self.kept[d] -= self.inputs[c]
        if a.phase is not Phase.FWD and self.need[d].get(j) == 0 and all(self.next_b[x] > j for x in self.mine[d]):
            del self.need[d][j]       # its forwards on this stage are all done: it claims no more room

    def _admit(self, d: int, j: int, c: int) -> bool:
        need, x = self.need[d], self.inputs[c]
        later = sum(self.inputs[y] for y in self.mine[d] if y >= c)
        base = self.kept[d] + self.pinned[d] + self.reserve[d]
        if self.policy.pinned:
            if j in need:
                need[j] -= x
                self.pinned[d] -= x
            elif base + later > self.limit[d]:
                return False
            else:
                need[j] = later - x
                self.pinned[d] += later - x
            self.kept[d] += x
            return True
        left = (need[j] if j in need else later) - x
        spare = max([left] + [n for i, n in need.items() if i != j]) if j > self.oldest else 0.0
        if base + x + spare > self.limit[d]:
            return False
        self.kept[d] += x
        need[j] = left
        return True

    def _backward(self, d: int, t: float, st: EventState) -> Optional[Action]:
        best = None
        room = self.limit[d] - self.kept[d] - self.pinned[d]
        for c in self.mine[d]:
            j = self.next_b[c]
            if j < self.m and (best is None or j < best.microbatch) and self.grow[c] <= room \
                    and st.ready_at(self.back, c, j, t):
                best = Action(self.back, j, c)
        if best is None:
            return None
        self.next_b[best.vstage] += 1
        if self.split:
            self.pending_w[d].append(Action(Phase.BWD_WEIGHT, best.microbatch, best.vstage))
        return best

    def _forward(self, d: int, t: float, st: EventState) -> Optional[Action]:
        for c in self.mine[d]:
            j = self.next_f[c]
            if j < self.m and st.ready_at(Phase.FWD, c, j, t) and self._admit(d, j, c):
                self.next_f[c] += 1
                return Action(Phase.FWD, j, c)
        return None

    def _weight(self, d: int) -> Optional[Action]:
        return self.pending_w[d].popleft() if self.pending_w[d] else None


def run_policy(name: str, placement: Sequence[int], microbatches: int, costs: ActionCosts, split: bool,
               limit: Sequence[float], kept: KeptBytes, policy: Policy) -> tuple[ScheduleTable, Simulation]:
    """The table one policy builds, and its simulation."""
    greedy = _Greedy(placement, microbatches, split, kept, limit, policy)
    p = len(greedy.mine)
    counts = [len(greedy.mine[d]) * microbatches * (3 if split else 2) for d in range(p)]
    spans = run_events(placement, microbatches, counts, greedy, lambda d, a: costs.duration(a.phase, a.vstage),
                       costs.send)
    table = ScheduleTable(name, tuple(placement), microbatches, tuple(tuple(o) for o in greedy.order))
    return table, finish(table, spans)


def generate(name: str, placement: Sequence[int], microbatches: int, costs: ActionCosts, split: bool,
             limit: Sequence[float], kept: Optional[KeptBytes] = None, seeds: Sequence[ScheduleTable] = ()
             ) -> tuple[ScheduleTable, Simulation]:
    """The shortest table, by simulation with ``costs``, of the ``seeds`` (replayed as they are) and the tables
    every `policies` entry builds under ``limit`` (per stage, in the units of ``kept``; default: one unit per live
    micro-batch of a whole stage)."""
    S = len(placement)
    if costs.num_vstages != S:
        raise ConfigError(f"costs for {costs.num_vstages} virtual stages, placement has {S}")
    if microbatches < 1:
        raise ConfigError(f"microbatches={microbatches} must be >= 1")
    p = max(placement) + 1
    if len(limit) != p:
        raise ConfigError(f"memory limit has {len(limit)} entries for {p} stages")
    v = S // p
    kept = kept or KeptBytes((1.0 / v,) * S, (1.0 / v,) * S)
    best = None
    for seed in seeds:
        if tuple(seed.placement) != tuple(placement) or any(
                a > b * (1 + 1e-9) for a, b in zip(peak_kept(seed, kept), limit)):
            continue
        sim = simulate(seed, costs)
        if best is None or sim.makespan < best[1].makespan:
            best = (seed, sim)
    for pol in policies(p):
        try:
            table, sim = run_policy(name, placement, microbatches, costs, split, limit, kept, pol)
        except ConfigError:
            # the greedy keeps room for every virtual stage's input and a B's stash at once; a seed (the fixed
            # pattern) may fit a limit below that (one micro-batch never needs both): the seeds stand
            if best is None:
                raise
            continue
        if best is None or sim.makespan < best[1].makespan * (1 - 1e-12):
            best = (table, sim)
    return improve(best[0], best[1], costs, limit, kept)


IMPROVE_BUDGET = 100_000    # simulated actions `improve` may spend (about 0.5 s of CPU: ~180k actions/s measured here)


def improve(table: ScheduleTable, sim: Simulation, costs: ActionCosts, limit: Sequence[float], kept: KeptBytes,
            budget: int = IMPROVE_BUDGET) -> tuple[ScheduleTable, Simulation]:
    """Hill-climb ``table``: swap two neighbouring actions of one stage (not two of the same micro-batch and
    virtual stage), keep the swap when the stage stays within its memory limit, the table does not deadlock and
    its simulated makespan falls; repeat until a pass over every neighbouring pair changes nothing or
    ``budget`` simulated actions are spent."""
    rows = [list(r) for r in table]
    size = sum(map(len, rows))
    spent, better = 0, True
    while better and spent + size <= budget:
        better = False
        for d, row in enumerate(rows):
            for i in range(len(row) - 1):
                a, b = row[i], row[i + 1]
                if (a.microbatch, a.vstage) == (b.microbatch, b.vstage) or spent + size > budget:
                    continue
                row[i], row[i + 1] = b, a
                cand = _swapped(table, rows, d, limit, kept)
                if cand is not None:
                    spent += size
                    try:
                        got = simulate(cand, costs)
                    except ConfigError:           # the swap deadlocks
                        got = None
                    if got is not None and got.makespan < sim.makespan * (1 - 1e-9):
                        table, sim, better = cand, got, True
                        continue
                row[i], row[i + 1] = a, b
    return table, sim


def _swapped(table: ScheduleTable, rows, d: int, limit: Sequence[float], kept: KeptBytes
             ) -> Optional[ScheduleTable]:
    """The table of ``rows`` if stage ``d`` (the one changed) keeps within its limit and runs no W before its
    B, else None."""
    cur, peak, seen = 0.0, 0.0, set()
    for a in rows[d]:
        if a.phase is Phase.BWD_INPUT:
            seen.add((a.vstage, a.microbatch))
        elif a.phase is Phase.BWD_WEIGHT and (a.vstage, a.microbatch) not in seen:
            return None
        cur += kept_change(a, kept)
        peak = max(peak, cur)
    if peak > limit[d] * (1 + 1e-9):
        return None
    return ScheduleTable(table.name, table.placement, table.microbatches, tuple(tuple(r) for r in rows))
