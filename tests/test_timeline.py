import json

import pytest

from cfp.errors import ConfigError
from cfp.runtime.timeline import MeasurementError, Phase, Timeline, bubble_line, theoretical_bubble
from references import load_timeline


def gpipe(tl, p, m, pipeline=0, fwd=1.0, bwd=1.0, t0=0.0):
    """Ideal GPipe: all forwards (diagonal), then all backwards in reverse stage order."""
    for s in range(p):
        for j in range(m):
            tl.record(pipeline, s, j, Phase.FWD, t0 + (s + j) * fwd, t0 + (s + j + 1) * fwd)
    tb = t0 + (m + p - 1) * fwd
    for s in range(p):
        for j in range(m):
            k = (p - 1 - s) + j
            tl.record(pipeline, s, j, "bwd", tb + k * bwd, tb + (k + 1) * bwd)
    return tl


@pytest.mark.parametrize("p,m", [(1, 4), (4, 8), (3, 2)])
def test_ideal_gpipe_matches_theory(p, m):
    tl = gpipe(Timeline(), p, m)
    assert tl.bubble_fraction(0) == pytest.approx(theoretical_bubble(p, m))
    assert tl.busy_time() == {(0, s): pytest.approx(2.0 * m) for s in range(p)}
    assert tl.makespan(0) == pytest.approx(2.0 * (m + p - 1))


def test_theoretical_bubble_and_errors():
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(1, 5) == 0.0
    with pytest.raises(ConfigError, match="num_stages"):
        theoretical_bubble(0, 4)
    tl = Timeline()
    with pytest.raises(ConfigError, match="phase='sideways'.*fwd"):
        tl.record(0, 0, 0, "sideways", 0, 1)
    with pytest.raises(ConfigError, match="before start"):
        tl.record(0, 0, 0, "fwd", 2, 1)
    with pytest.raises(ConfigError, match="zero-length or reversed event is not a measurement"):
        tl.record(0, 1, 0, "bwd", 1.5, 1.5)
    assert len(tl) == 0
    with pytest.raises(ConfigError, match="pipeline 3 has no events"):
        tl.bubble_fraction(3)


def test_pipelines_are_separate_and_overlap_counted_once():
    tl = gpipe(Timeline(), 2, 4, pipeline=0)
    gpipe(tl, 3, 6, pipeline=1, fwd=0.5, bwd=1.0, t0=100.0)
    assert tl.pipelines() == [0, 1]
    assert tl.bubble_fraction(0) == pytest.approx(theoretical_bubble(2, 4))
    # unequal fwd/bwd: busy = m*(f+b) per stage, makespan = (m+p-1)*(f+b)
    assert tl.bubble_fraction(1) == pytest.approx(theoretical_bubble(3, 6))
    t2 = Timeline()
    t2.record(0, 0, 0, "fwd", 0.0, 2.0)
    t2.record(0, 0, 1, "fwd", 1.0, 3.0)  # overlaps the first
    assert t2.busy_time() == {(0, 0): pytest.approx(3.0)}
    assert t2.bubble_fraction(0, num_stages=2) == pytest.approx(0.5)


def test_span_uses_clock():
    ticks = iter([1.0, 1.5])
    tl = Timeline(clock=lambda: next(ticks))
    with tl.span(0, 1, 2, "bwd"):
        pass
    (ev,) = tl.events
    assert (ev.stage, ev.microbatch, ev.phase, ev.duration) == (1, 2, Phase.BWD, 0.5)


def test_json_roundtrip_and_png(tmp_path):
    tl = gpipe(Timeline(), 4, 8)
    gpipe(tl, 2, 8, pipeline=1, fwd=0.7, bwd=1.4)
    tl.save_json(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["events"][0]["phase"] == "fwd"
    back = load_timeline(tmp_path / "t.json")
    assert back.events == tl.events
    tl.plot_png(tmp_path / "t.png", title="ideal GPipe")
    data = (tmp_path / "t.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ConfigError, match="not a cfp timeline"):
        load_timeline(tmp_path / "bad.json")


def test_bubble_below_the_schedules_minimum_is_invalid():
    """An ideal schedule reaches (p-1)/(m+p-1) exactly (valid); stage 1 squeezed in beside stage 0 as if it
    needed no activation (what inferred starts and ends gave: 22.5% vs 66.7% at p=3, m=1) is flagged INVALID
    and `check` raises; an unbalanced schedule idles more than the minimum and is valid."""
    ideal = gpipe(Timeline(), 3, 1)
    (v,) = ideal.summary().values()
    assert v["valid"] and v["bubble"] == pytest.approx(2 / 3) == v["minimum_bubble"]
    assert "INVALID" not in bubble_line(0, v) and "below" not in bubble_line(0, v)
    ideal.check()
    bad = Timeline()
    for s in range(3):                       # every stage busy at once: bubble 0 < 2/3
        bad.record(0, s, 0, "fwd", 0.0, 1.0)
        bad.record(0, s, 0, "bwd", 1.0, 2.0)
    (v,) = bad.summary().values()
    assert not v["valid"] and v["bubble"] == pytest.approx(0.0) and v["minimum_bubble"] == pytest.approx(2 / 3)
    assert bubble_line(0, v).endswith("INVALID: below the minimum its measured action times allow (66.7%), so "
                                      "the timings are wrong (a measuring bug)")
    with pytest.raises(MeasurementError, match="bubble measured 0.0% vs theoretical 66.7% .p=3, m=1. INVALID"):
        bad.check()
    slow = gpipe(Timeline(), 2, 4, fwd=1.0, bwd=3.0)
    slow.record(0, 1, 9, "fwd", 100.0, 101.0)     # a late straggler on stage 1: more idle time, still valid
    (v,) = slow.summary().values()
    assert v["valid"] and v["bubble"] > v["theoretical_bubble"]


def test_uneven_action_times_may_idle_less_than_the_equal_time_figure():
    """(p-1)/(m+p-1) assumes equal action times. 1F1B, p=2, m=2 with stage 0's first forward and last backward
    nearly free overlaps the rest completely: a bubble near 0 that is a true measurement, not a bug (the
    critical path through these times equals the makespan), so it is valid and the line says why it is low."""
    tl, eps = Timeline(), 1e-3
    tl.record(0, 0, 0, "fwd", 0.0, eps)
    tl.record(0, 1, 0, "fwd", eps, 1.0)
    tl.record(0, 0, 1, "fwd", eps, 2.0)
    tl.record(0, 1, 0, "bwd", 1.0, 2.0)
    tl.record(0, 1, 1, "fwd", 2.0, 3.0)
    tl.record(0, 0, 0, "bwd", 2.0, 4.0)
    tl.record(0, 1, 1, "bwd", 3.0, 4.0)
    tl.record(0, 0, 1, "bwd", 4.0, 4.0 + eps)
    (v,) = tl.summary().values()
    assert v["valid"] and v["bubble"] < 0.01 < v["theoretical_bubble"] == pytest.approx(1 / 3)
    assert "because the measured action times vary" in bubble_line(0, v)
    tl.check()


def test_a_step_not_measured_in_full_still_writes_its_timeline_without_a_bubble(tmp_path):
    """A busy host can miss when an action starts; the run still writes what it measured (the user asked for
    a timeline) but reports no bubble, which the missing busy time would make too large."""
    from types import SimpleNamespace

    from cfp.layout import Layout
    from cfp.schedules.registry import ScheduleName
    from cfp.runtime.training import _timeline
    full = gpipe(Timeline(), 2, 2).events
    from cfp.runtime.training import RunOptions
    opts = RunOptions(timeline_dir=str(tmp_path / "tl"), schedule=ScheduleName.GPIPE,
                      layout=Layout.from_lists([[1, 1]], [[1, 1]], [2], [2]))
    job = SimpleNamespace(model=SimpleNamespace(name="gpt"))
    said = []
    bubbles = _timeline(opts, job, full[1:], said.append, len(full))
    assert bubbles == {}
    assert any(line.startswith("bubble not measured: no step had every action measured (1 of 8") for line in said)
    data = json.loads((tmp_path / "tl" / "timeline.json").read_text())
    assert data["unmeasured"] == 1 and len(data["events"]) == 7
    assert (tmp_path / "tl" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = load_timeline(tmp_path / "tl" / "timeline.json")
    with pytest.raises(ConfigError, match="no bubble: 1 actions of the step were not measured"):
        loaded.summary()
    said.clear()     # measured in full: the bubble is the events' own (1/3 for p=2, m=2 with equal times)
    bubbles = _timeline(opts, job, full, said.append, len(full))
    assert bubbles[0]["bubble"] == pytest.approx(1 / 3)
    assert json.loads((tmp_path / "tl" / "timeline.json").read_text())["unmeasured"] == 0
    with pytest.raises(ConfigError, match="unmeasured=-1 is invalid"):
        Timeline(unmeasured=-1)


def test_split_backward_replays_and_bounds_its_makespan():
    """A ZB-H1 step's measured B and W (here: a simulated one's spans, uneven stages) replayed by the event
    simulation give that step's makespan; the critical path through B and W (B after the next stage's B, W after
    its B) is that makespan too, and a W recorded before its B contradicts the schedule (inf)."""
    import dataclasses
    from cfp.schedules.registry import SCHEDULES, ScheduleName
    from cfp.schedules.simulate import ActionCosts, simulate
    from cfp.runtime.timeline import Event, critical_path, median_action_seconds, replay_measured
    table = SCHEDULES[ScheduleName.ZB_H1].pattern(3, 6)
    costs = ActionCosts.per_stage([1.0, 2.0, 1.0], [1.0, 1.5, 1.2], [0.5, 1.0, 0.7], table.placement)
    sim = simulate(table, costs)
    events = [Event(0, s.stage, s.microbatch, s.phase, s.start, s.end) for s in sim.spans]
    got = replay_measured(events, table)
    assert got.makespan == pytest.approx(sim.makespan) and got.bubble == pytest.approx(sim.bubble)
    assert critical_path(events) == pytest.approx(sim.makespan)
    f, b, w = median_action_seconds(events, 3)
    assert (f, b, w) == (pytest.approx([1.0, 2.0, 1.0]), pytest.approx([1.0, 1.5, 1.2]), pytest.approx([0.5, 1.0, 0.7]))
    slow = [dataclasses.replace(e, end=e.start + 3 * e.duration) if e.phase is Phase.BWD_WEIGHT and e.stage == 1
            else e for e in events]     # a slower W on the middle stage: the replay takes it
    assert replay_measured(slow, table).makespan > sim.makespan
    b0 = next(e for e in events if (e.stage, e.microbatch, e.phase) == (0, 0, Phase.BWD_INPUT))
    early = [dataclasses.replace(e, start=b0.start - 2.0, end=b0.start - 1.0)
             if (e.stage, e.microbatch, e.phase) == (0, 0, Phase.BWD_WEIGHT) else e for e in events]
    assert critical_path(early) == float("inf")


def test_virtual_stage_events_replay_and_summarise_per_stage():
    """Events of a ZB-V step name virtual stages (what the engine records under virtual stages): replayed in the
    simulation of the table they ran they give its makespan, and `summary(placements)` counts busy time and the
    bubble per stage (its two virtual stages together), not per virtual stage."""
    from cfp.schedules.registry import SCHEDULES, ScheduleName
    from cfp.schedules.simulate import ActionCosts, simulate
    from cfp.runtime.timeline import Event, Timeline, median_action_seconds, replay_measured
    table = SCHEDULES[ScheduleName.ZB_V].pattern(3, 6)
    costs = ActionCosts((1.0, 2.0, 1.0, 0.5, 1.0, 1.5), (1.0, 1.5, 1.2, 0.4, 1.0, 1.0), (0.5, 1.0, 0.7, 0.3, 0.6, 0.8))
    sim = simulate(table, costs)
    events = [Event(0, s.vstage, s.microbatch, s.phase, s.start, s.end) for s in sim.spans]
    got = replay_measured(events, table)
    assert got.makespan == pytest.approx(sim.makespan) and got.busy == pytest.approx(sim.busy)
    assert median_action_seconds(events, 6) == (pytest.approx(list(costs.fwd)), pytest.approx(list(costs.bwd_input)),
                                                pytest.approx(list(costs.bwd_weight)))
    tl = Timeline(events)
    v = tl.summary([table.placement])[0]
    assert v["stages"] == 3 and v["valid"]
    assert v["bubble"] == pytest.approx(1.0 - sum(sim.busy) / (3 * sim.makespan))
    assert tl.summary()[0]["stages"] == 6       # without placements: one row per virtual stage
