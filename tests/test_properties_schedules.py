"""The schedule generator and registry as properties over numbers (hypothesis, the deterministic profile of
conftest.py: derandomized, no deadline).

For any schedule of the registry (every placement, ``v`` from 1 to 4), any number of stages and of micro-batches
from 1 (past 9: micro-batch ids of two digits), random per-virtual-stage F, B and W seconds and random bytes kept
per micro-batch, ``Schedule.generated`` gives a table that is

* valid: every virtual stage runs each micro-batch's F once and its backward once (whole, or B then W on its
  stage), on the stage it is placed on, and the stages' orders run to the end (an executor written here);
* within its memory: what each stage keeps (F keeps its input until its B or whole backward, B keeps W's stash
  until W), counted here, is within the limit it was given -- the fixed pattern's own peak;
* never longer than the fixed pattern it was seeded with: both timed by an as-soon-as-possible replay written
  here (no send times), which also gives the makespan the generator reports.

`generate` itself is checked the same way on random placements (each stage holding ``v`` virtual stages in any
order) seeded with a GPipe-ordered table. The references here share nothing with `cfp.schedules` but the
`Action` and `ScheduleTable` types.
"""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cfp.schedules.actions import Action, KeptBytes, Phase, Placement, ScheduleTable
from cfp.schedules.generate import generate
from cfp.schedules.registry import SCHEDULES, ScheduleName
from cfp.schedules.simulate import ActionCosts

REL = 1e-9


def _placement_v(draw, name: ScheduleName) -> int:
    placement = SCHEDULES[name].placement
    return {Placement.LINEAR: 1, Placement.V: 2}.get(placement) or draw(st.integers(2, 4))


def _times(draw, n: int, lo: float = 0.05, hi: float = 4.0) -> tuple[float, ...]:
    return tuple(draw(st.lists(st.floats(lo, hi), min_size=n, max_size=n)))


@st.composite
def schedule_cases(draw):
    """(schedule name, p, m, v, costs per virtual stage, kept bytes per virtual stage or None)."""
    name = draw(st.sampled_from(list(ScheduleName)))
    v = _placement_v(draw, name)
    p = draw(st.integers(1, 4))
    m = draw(st.one_of(st.integers(1, 12), st.integers(10, 16)))
    n = v * p
    costs = ActionCosts(_times(draw, n), _times(draw, n), _times(draw, n))
    kept = None if draw(st.booleans()) else KeptBytes(_times(draw, n, 0.1, 3.0), _times(draw, n, 0.0, 3.0))
    return name, p, m, v, costs, kept


# ----------------------------------------------------------------------------- the references
def grad_key(phase: Phase, c: int, j: int) -> tuple:
    return ("grad", c, j) if phase in (Phase.BWD, Phase.BWD_INPUT) else (phase.value, c, j)


def needs(a: Action, num_vstages: int) -> list[tuple]:
    """What ``a`` waits for, from the pipeline's definition: F after the previous virtual stage's F; a backward
    (B or whole) after its F and the next virtual stage's input gradient; W after its B."""
    c, j = a.vstage, a.microbatch
    if a.phase is Phase.FWD:
        return [("fwd", c - 1, j)] if c > 0 else []
    if a.phase is Phase.BWD_WEIGHT:
        return [("grad", c, j)]
    return [("fwd", c, j)] + ([("grad", c + 1, j)] if c + 1 < num_vstages else [])


def duration(costs: ActionCosts, a: Action) -> float:
    c = a.vstage
    return {Phase.FWD: costs.fwd[c], Phase.BWD_INPUT: costs.bwd_input[c], Phase.BWD_WEIGHT: costs.bwd_weight[c],
            Phase.BWD: costs.bwd_input[c] + costs.bwd_weight[c]}[a.phase]


def replay(table: ScheduleTable, costs: ActionCosts) -> float:
    """The makespan of running each stage's actions in its order, each as soon as its stage is free and what it
    needs has ended (no send times); AssertionError when the orders deadlock."""
    S = len(table.placement)
    pos, free, end = [0] * len(table.actions), [0.0] * len(table.actions), {}
    total = sum(map(len, table.actions))
    while len(end) < total:
        moved = False
        for d, row in enumerate(table.actions):
            while pos[d] < len(row) and all(k in end for k in needs(row[pos[d]], S)):
                a = row[pos[d]]
                start = max([free[d]] + [end[k] for k in needs(a, S)])
                free[d] = end[grad_key(a.phase, a.vstage, a.microbatch)] = start + duration(costs, a)
                pos[d], moved = pos[d] + 1, True
        assert moved, f"the orders deadlock at {[row[i] for row, i in zip(table.actions, pos) if i < len(row)]}"
    return max(end.values(), default=0.0)


def peaks(table: ScheduleTable, kept: KeptBytes) -> list[float]:
    """Per stage, the most it keeps at once (its own order decides it)."""
    out = []
    for row in table.actions:
        cur = peak = 0.0
        for a in row:
            c = a.vstage
            cur += {Phase.FWD: kept.inputs[c], Phase.BWD: -kept.inputs[c],
                    Phase.BWD_INPUT: kept.weight[c] - kept.inputs[c], Phase.BWD_WEIGHT: -kept.weight[c]}[a.phase]
            peak = max(peak, cur)
        out.append(peak)
    return out


def assert_valid(table: ScheduleTable, placement, m: int, split: bool) -> None:
    """Every action once, on its stage, W after its B on that stage; the orders run to the end."""
    assert tuple(table.placement) == tuple(placement) and table.microbatches == m
    backs = (Phase.BWD_INPUT, Phase.BWD_WEIGHT) if split else (Phase.BWD,)
    want = sorted((ph.value, c, j) for c in range(len(placement)) for ph in (Phase.FWD,) + backs for j in range(m))
    assert sorted((a.phase.value, a.vstage, a.microbatch) for row in table.actions for a in row) == want
    for d, row in enumerate(table.actions):
        assert all(placement[a.vstage] == d for a in row), f"stage {d} runs another stage's virtual stage"
        done_b = set()
        for a in row:
            if a.phase is Phase.BWD_INPUT:
                done_b.add((a.vstage, a.microbatch))
            assert a.phase is not Phase.BWD_WEIGHT or (a.vstage, a.microbatch) in done_b, f"W before B: {a}"
    replay(table, ActionCosts(*([(1.0,) * len(placement)] * 3)))


def units(placement) -> KeptBytes:
    v = len(placement) // (max(placement) + 1)
    return KeptBytes((1.0 / v,) * len(placement), (1.0 / v,) * len(placement))


# ----------------------------------------------------------------------------- properties
@settings(max_examples=40)
@given(schedule_cases())
def test_generated_tables_are_valid_within_memory_and_never_longer_than_the_pattern(case):
    name, p, m, v, costs, kept = case
    entry = SCHEDULES[name]
    placement = entry.placement.stages(p, v)
    pattern = entry.pattern(p, m, v)
    assert_valid(pattern, placement, m, entry.split)
    assert_valid(entry(p, m, v), placement, m, entry.split)         # the table the runtime runs
    # the limit the runtime gives: the pattern's own peak under the kept bytes (the unit default otherwise)
    limit = None if kept is None else peaks(pattern, kept)
    table, sim = entry.generated(p, m, costs, v, limit, kept)
    assert_valid(table, placement, m, entry.split)
    got, bound = peaks(table, kept or units(placement)), limit or entry.unit_limit(p, m, v)
    assert all(a <= b * (1 + REL) for a, b in zip(got, bound)), (got, bound)
    if kept is None:
        assert all(a <= b * (1 + REL) for a, b in zip(peaks(pattern, units(placement)), bound))
    mine, fixed = replay(table, costs), replay(pattern, costs)
    assert abs(sim.makespan - mine) <= REL * mine, (sim.makespan, mine)
    assert mine <= fixed * (1 + REL), f"generated {mine} is longer than the pattern's {fixed}"


def gpipe_ordered(name: str, placement, m: int, split: bool) -> ScheduleTable:
    """All forwards by (micro-batch, virtual stage), then all backwards by (micro-batch, virtual stage from the
    last), Ws right after their B: one global order, so each stage's share of it cannot deadlock."""
    S = len(placement)
    back = [Phase.BWD_INPUT, Phase.BWD_WEIGHT] if split else [Phase.BWD]
    order = [Action(Phase.FWD, j, c) for j in range(m) for c in range(S)]
    order += [Action(ph, j, c) for j in range(m) for c in reversed(range(S)) for ph in back]
    rows = tuple(tuple(a for a in order if placement[a.vstage] == d) for d in range(max(placement) + 1))
    return ScheduleTable(name, tuple(placement), m, rows)


@st.composite
def placement_cases(draw):
    p, v = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rng = random.Random(draw(st.integers(0, 2 ** 16)))
    placement = [d for d in range(p) for _ in range(v)]
    rng.shuffle(placement)
    n, m = p * v, draw(st.one_of(st.integers(1, 12), st.integers(10, 14)))
    costs = ActionCosts(_times(draw, n), _times(draw, n), _times(draw, n))
    return tuple(placement), m, draw(st.booleans()), costs


@settings(max_examples=25)
@given(placement_cases())
def test_generate_on_any_placement_keeps_the_seeds_memory_and_time(case):
    placement, m, split, costs = case
    seed = gpipe_ordered("any", placement, m, split)
    assert_valid(seed, placement, m, split)
    kept = units(placement)
    limit = peaks(seed, kept)
    table, sim = generate("any", placement, m, costs, split, limit, kept, [seed])
    assert_valid(table, placement, m, split)
    assert all(a <= b * (1 + REL) for a, b in zip(peaks(table, kept), limit))
    mine = replay(table, costs)
    assert abs(sim.makespan - mine) <= REL * mine
    assert mine <= replay(seed, costs) * (1 + REL)
