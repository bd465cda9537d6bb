"""The timeline's statistics as properties (hypothesis, the deterministic profile of conftest.py).

* A stalled action moves no median: `median_action_seconds` (what the generated tables are built from) gives, per
  stage, the median of its F, B (whole backwards counted there) and W; stalling the slowest action of a group (of
  three or more) by any factor leaves every median exactly as it was, stalling fewer than half of a group keeps
  its median between its old value and the group's old maximum, and no other group moves. A mean, or one group's
  figure taken from another's actions, fails it.
* Pipelines of different speeds keep their own figures: the events of several pipelines (each a simulated run
  of its schedule at its own speed, all from time 0) give per pipeline the medians (`median_costs`), makespan,
  busy time, bubble and critical path that pipeline's events alone give, and those are the simulated ones.

References are written here (numpy's median over each group, sums over each stage's spans).
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cfp.runtime.measured_tables import median_costs
from cfp.runtime.timeline import Event, Timeline, critical_path, median_action_seconds, replay_measured
from cfp.schedules.actions import Phase
from cfp.schedules.registry import SCHEDULES, ScheduleName
from cfp.schedules.simulate import ActionCosts, simulate

GROUPS = ((Phase.FWD,), (Phase.BWD_INPUT, Phase.BWD), (Phase.BWD_WEIGHT,))


@st.composite
def stage_events(draw):
    """Events of pipeline 0: per stage and group 1..11 durations (a backward group mixing B and whole
    backwards), laid one after another on each stage."""
    p = draw(st.integers(1, 4))
    events = []
    for s in range(p):
        t = 0.0
        for g, phases in enumerate(GROUPS):
            n = draw(st.integers(0 if g == 2 else 1, 11))
            for j in range(n):
                d = draw(st.floats(0.01, 10.0))
                events.append(Event(0, s, j, draw(st.sampled_from(phases)), t, t + d))
                t += d
    return p, events


def reference_medians(events, p: int) -> list[list[float]]:
    return [[float(np.median([e.duration for e in events if e.stage == s and e.phase in phases]))
             if any(e.stage == s and e.phase in phases for e in events) else 0.0 for s in range(p)]
            for phases in GROUPS]


def stalled(e: Event, factor: float) -> Event:
    return Event(e.pipeline, e.stage, e.microbatch, e.phase, e.start, e.start + e.duration * factor)


@settings(max_examples=60)
@given(stage_events(), st.floats(2.0, 1e4), st.data())
def test_a_stalled_action_moves_no_median(case, factor, data):
    p, events = case
    before = [list(r) for r in median_action_seconds(events, p)]
    assert np.allclose(before, reference_medians(events, p), rtol=0, atol=0)
    groups = [(g, s, [i for i, e in enumerate(events) if e.stage == s and e.phase in phases])
              for g, phases in enumerate(GROUPS) for s in range(p)]
    groups = [x for x in groups if len(x[2]) >= 3]       # of one or two actions, every action sets the median
    if not groups:
        return
    g, s, idx = data.draw(st.sampled_from(groups))
    slowest = max(idx, key=lambda i: events[i].duration)
    after = median_action_seconds([stalled(e, factor) if i == slowest else e for i, e in enumerate(events)], p)
    assert [list(r) for r in after] == before
    # fewer than half of the group stalled: its median stays within its old median and maximum
    some = set(data.draw(st.lists(st.sampled_from(idx), max_size=(len(idx) - 1) // 2, unique=True)))
    after = median_action_seconds([stalled(e, factor) if i in some else e for i, e in enumerate(events)], p)
    top = max(events[i].duration for i in idx)
    assert before[g][s] <= after[g][s] <= top * (1 + 1e-12)
    assert all(after[h][t] == before[h][t] for h in range(3) for t in range(p) if (h, t) != (g, s))


@st.composite
def pipelines(draw):
    """2-3 pipelines, each its schedule, stages, micro-batches (past 9 too) and speed (a factor on shared
    per-stage times)."""
    out = []
    for _ in range(draw(st.integers(2, 3))):
        name = draw(st.sampled_from([ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1]))
        p, m = draw(st.integers(1, 4)), draw(st.one_of(st.integers(1, 6), st.integers(10, 13)))
        speed = draw(st.floats(0.2, 5.0))
        times = [tuple(speed * draw(st.floats(0.1, 2.0)) for _ in range(p)) for _ in range(3)]
        out.append((SCHEDULES[name].pattern(p, m), ActionCosts(*times)))
    return out


@settings(max_examples=30)
@given(pipelines())
def test_pipelines_of_different_speeds_keep_their_own_figures(pipes):
    sims = [simulate(table, costs) for table, costs in pipes]
    events = [Event(q, sp.vstage, sp.microbatch, sp.phase, sp.start, sp.end)
              for q, sim in enumerate(sims) for sp in sim.spans]
    tl = Timeline(events)
    summary = tl.summary()
    for q, ((table, costs), sim) in enumerate(zip(pipes, sims)):
        own = [e for e in events if e.pipeline == q]
        alone = Timeline(own).summary()[q]
        assert summary[q] == alone
        p = table.num_stages
        # the medians: exactly the pipeline's own action times (every action of a kind takes the same here)
        med = median_costs(events, q, p)
        want_b = costs.bwd_input if table.split else tuple(b + w for b, w in zip(costs.bwd_input, costs.bwd_weight))
        np.testing.assert_allclose(med.fwd, costs.fwd, rtol=1e-12)
        np.testing.assert_allclose(med.bwd_input, want_b, rtol=1e-12)
        np.testing.assert_allclose(med.bwd_weight, costs.bwd_weight if table.split else (0.0,) * p, rtol=1e-12)
        # makespan, busy time, critical path and replay: the simulated run's
        assert abs(summary[q]["makespan"] - sim.makespan) <= 1e-9 * sim.makespan
        assert np.allclose([tl.busy_time(q)[(q, s)] for s in range(p)], sim.busy, rtol=1e-9)
        assert abs(critical_path(own) - sim.makespan) <= 1e-9 * sim.makespan     # an ASAP run is its path
        assert summary[q]["valid"] and abs(summary[q]["minimum_bubble"] - summary[q]["bubble"]) <= 1e-9
        assert abs(replay_measured(own, table).makespan - sim.makespan) <= 1e-9 * sim.makespan
        assert summary[q]["microbatches"] == table.microbatches and summary[q]["stages"] == p
