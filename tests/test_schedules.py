"""Pipeline schedules as data (`cfp.schedules.registry`): tables over virtual stages, their validation, the event
simulation, the generator and the theory -- on cases small enough to work out by hand, and on broken tables."""
import itertools
import random

import pytest

from cfp.errors import ConfigError
from cfp.schedules.actions import (Action, KeptBytes, Phase, Placement, ScheduleTable, check_table, global_order,
                                   live_microbatches, peak_kept, vstage_layers)
from cfp.schedules.generate import generate
from cfp.schedules.registry import SCHEDULES, ScheduleName, ScheduleSpec, schedule_choices
from cfp.schedules.simulate import ActionCosts, simulate

F, BW, B, W = Phase.FWD, Phase.BWD, Phase.BWD_INPUT, Phase.BWD_WEIGHT


def _equal(entry, p, f=1.0, b=1.0, w=1.0, v=None):
    """Equal stages: per stage F, B, W seconds, shared evenly by its virtual stages."""
    return ActionCosts.per_stage([f] * p, [b] * p, [w] * p, entry.placement.stages(p, v or entry.default_v))


# ----------------------------------------------------------------------------- by hand
def test_1f1b_on_two_stages_by_hand():
    # F = 1, whole backward = 2: s0 F0 [0,1] F1 [1,2]; s1 F0 [1,2] BW0 [2,4] F1 [4,5] BW1 [5,7];
    # s0 BW0 [4,6] BW1 [7,9]: 9 = (m + p - 1) * 3, each stage idle 3 of 9
    sim = simulate(SCHEDULES[ScheduleName.ONE_F_ONE_B].pattern(2, 2), ActionCosts((1., 1.), (1., 1.), (1., 1.)))
    assert sim.makespan == 9.0 and sim.busy == (6.0, 6.0)
    assert sim.bubble == pytest.approx(1 / 3) and sim.imbalance == 0.0
    assert [(s.stage, s.phase, s.microbatch, s.start) for s in sim.spans if s.stage == 0] == \
        [(0, F, 0, 0.0), (0, F, 1, 1.0), (0, BW, 0, 4.0), (0, BW, 1, 7.0)]


def test_each_link_carries_one_transfer_at_a_time():
    # GPipe, 2 stages, F = 1, whole backward = 1, 3 s per transfer. Stage 0's two outputs queue on the one
    # link 0 -> 1: [1,4] then [4,7]; stage 1: F0 [4,5] F1 [7,8] BW0 [8,9] BW1 [9,10]; the gradients queue on
    # 1 -> 0: [9,12] then [12,15]; stage 0: BW0 [12,13] BW1 [15,16]
    sim = simulate(SCHEDULES[ScheduleName.GPIPE].pattern(2, 2), ActionCosts((1., 1.), (.5, .5), (.5, .5), (3.,)))
    assert sim.makespan == 16.0 and sim.busy == (4.0, 4.0) and sim.bubble == 0.75
    assert [s.start for s in sim.spans if s.stage == 1] == [4.0, 7.0, 8.0, 9.0]
    assert [s.start for s in sim.spans if s.stage == 0 and s.phase is BW] == [12.0, 15.0]


@pytest.mark.parametrize("fbw, want", [
    # p = 4, m = 8: m(F+B+W) plus the busiest stage's idle time, (schedule_time's table)
    ((1, 1, 1), {"gpipe": 24 + 9, "1f1b": 24 + 9, "interleaved": 24 + 4.5, "zb-h1": 24 + 3, "zb-v": 24 + 1.5}),
    ((1, 2, 1), {"gpipe": 32 + 12, "1f1b": 32 + 12, "interleaved": 32 + 6, "zb-h1": 32 + 6, "zb-v": 32 + 3}),
])
def test_theory_with_equal_stages(fbw, want):
    f, b, w = fbw
    for name, entry in SCHEDULES.items():
        costs = _equal(entry, 4, f, b, w)
        assert entry.theory(4, 8, f, b, w) == want[name.value], name
        table, sim = entry.generated(4, 8, costs)
        assert sim.makespan == want[name.value], name
        if entry.fixed(4, 8, entry.default_v) is not None:      # the written-out pattern is what theory says
            assert simulate(entry.pattern(4, 8), costs).makespan == want[name.value], name
    # the bubble (busiest stage idle) against 1F1B's: ZB-H1 a third, ZB-V a sixth, interleaved 1/v (F = B = W)
    if fbw == (1, 1, 1):
        bubble = {n: (t - 24) / t for n, t in want.items()}
        assert bubble["zb-h1"] <= bubble["1f1b"] / 2 and bubble["zb-v"] <= bubble["1f1b"] / 4
        assert bubble["interleaved"] == pytest.approx(4.5 / 28.5)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_patterns_reach_their_theory(p):
    for fbw in ((1, 1, 1), (1, 2, 1), (1, 1, .5), (1, .5, 1)):
        for name, entry in SCHEDULES.items():
            m = 2 * p
            t = entry.theory(p, m, *fbw)
            _, sim = entry.generated(p, m, _equal(entry, p, *fbw))
            if name is ScheduleName.ZB_V and fbw != (1, 1, 1):
                assert sim.makespan >= m * sum(fbw)      # its formula is an estimate there, not a bound
            else:
                assert sim.makespan == pytest.approx(t), (name, fbw)


def test_generated_schedule_beats_the_fixed_pattern_on_uneven_stages():
    # stage 2 is slowest (F 3, B 6, W 3: 12 s per micro-batch). Nothing can finish before its first forward
    # arrives (stages 0 and 1: 2 + 2 s) plus its own 8 x 12 s: 100 s. The generator reaches that; the ZB-H1
    # pattern, written for equal stages, leaves the slow stage idle and takes 104 s.
    f = [2, 2, 3, 2]
    costs = ActionCosts.per_stage(f, [2 * x for x in f], f, (0, 1, 2, 3))
    zb_h1 = SCHEDULES[ScheduleName.ZB_H1]
    assert simulate(zb_h1.pattern(4, 8), costs).makespan == 104.0
    table, sim = zb_h1.generated(4, 8, costs)
    assert sim.makespan == 100.0 and simulate(table, costs).makespan == 100.0
    assert sim.busy[2] == 96.0 and sim.bubble == pytest.approx(0.04)


# ----------------------------------------------------------------------------- validation
def _zb(p=3, m=4) -> ScheduleTable:
    return SCHEDULES[ScheduleName.ZB_H1].pattern(p, m)


def _with(table: ScheduleTable, stage: int, acts) -> ScheduleTable:
    rows = list(table.actions)
    rows[stage] = tuple(acts)
    return ScheduleTable(table.name, table.placement, table.microbatches, tuple(rows))


def test_validation_names_what_is_wrong():
    t = _zb()
    check_table(t, [3.0] * 3)
    row = list(t[1])
    w = next(i for i, a in enumerate(row) if a.phase is W)
    with pytest.raises(ConfigError, match=r"does not run every action once .*missing \[\('bwd_weight', 1, 0\)"):
        check_table(_with(t, 1, row[:w] + row[w + 1:]))                       # a W dropped
    with pytest.raises(ConfigError, match="extra or repeated"):
        check_table(_with(t, 1, row + [row[w]]))                              # a W run twice
    b = row.index(Action(B, row[w].microbatch, 1))
    moved = row[:b] + row[b + 1:]
    moved.insert(w - 1, row[b])
    moved.remove(row[w])
    moved.insert(b, row[w])
    with pytest.raises(ConfigError, match="runs W0 of virtual stage 1 before its B"):
        check_table(_with(t, 1, moved))                                       # W before its B
    rows = [list(r) for r in t]
    rows[2].append(rows[1].pop())                                             # a virtual stage on the wrong stage
    with pytest.raises(ConfigError, match="stage 2 runs W3 of virtual stage 1, which is placed on stage 1"):
        check_table(ScheduleTable(t.name, t.placement, t.microbatches, tuple(map(tuple, rows))))
    first_b = next(i for i, a in enumerate(t[0]) if a.phase is B)             # B before its own F can be there
    with pytest.raises(ConfigError, match="deadlocks"):
        check_table(_with(t, 0, [t[0][first_b]] + [a for i, a in enumerate(t[0]) if i != first_b]))
    with pytest.raises(ConfigError, match="stage 0 keeps 3 at its peak, over its memory limit 2"):
        check_table(t, [2.0, 3.0, 3.0])


def test_every_dispatched_action_follows_its_inputs():
    """The executor's order: each action after the actions it consumes (re-derived here, not `dependencies`)."""
    for name, entry in SCHEDULES.items():
        table = entry.pattern(4, 6)
        S = table.num_vstages
        when = {}
        for g in global_order([table]):
            c, j = g.vstage, g.microbatch
            if g.phase is F:
                need = [("F", c - 1, j)] if c else []
            elif g.phase is W:
                need = [("B", c, j)]
            else:
                need = [("F", c, j)] + ([("B", c + 1, j)] if c + 1 < S else [])
            assert all(when.get(k, g.tick) < g.tick for k in need), (name, g)
            assert table.placement[c] == g.stage
            when[("F" if g.phase is F else "W" if g.phase is W else "B", c, j)] = g.tick
        assert len(when) == sum(map(len, table))


def _random_costs(rng, entry, p, v, sends=True):
    n = p * v
    return ActionCosts(tuple(rng.uniform(.2, 2) for _ in range(n)), tuple(rng.uniform(.2, 3) for _ in range(n)),
                       tuple(rng.uniform(.1, 2) for _ in range(n)),
                       tuple(rng.uniform(0, 1) if sends else 0.0 for _ in range(n - 1)))


@pytest.mark.parametrize("seed", range(3))
def test_simulation_starts_nothing_before_its_inputs_arrive(seed):
    rng = random.Random(seed)
    for name, entry in SCHEDULES.items():
        p, v = rng.randint(2, 4), entry.default_v
        costs = _random_costs(rng, entry, p, v)
        table, sim = entry.generated(p, 2 * p, costs, v)
        S = table.num_vstages
        span = {(s.phase if s.phase is not BW else B, s.vstage, s.microbatch): s for s in sim.spans}
        for s in sim.spans:
            c, j = s.vstage, s.microbatch
            assert s.end - s.start == pytest.approx(costs.duration(s.phase, c))
            if s.phase is F and c:
                prev = span[(F, c - 1, j)]
                assert s.start >= prev.end + (0 if prev.stage == s.stage else costs.send[c - 1]) - 1e-9
            if s.phase in (B, BW):
                assert s.start >= span[(F, c, j)].end - 1e-9
                if c + 1 < S:          # the next virtual stage's input gradient, sent back
                    nxt = span[(B, c + 1, j)]
                    assert s.start >= nxt.end + (0 if nxt.stage == s.stage else costs.send[c]) - 1e-9, name
            if s.phase is W:
                assert s.start >= span[(B, c, j)].end - 1e-9
        for d in range(p):             # a stage runs its table's order, one action at a time
            mine = [s for s in sim.spans if s.stage == d]
            assert [(s.phase, s.microbatch, s.vstage) for s in mine] == list(table[d])
            assert all(a.end <= b.start + 1e-9 for a, b in zip(mine, mine[1:]))


# ----------------------------------------------------------------------------- generator and memory
@pytest.mark.parametrize("seed", range(4))
def test_generated_tables_keep_within_byte_limits(seed):
    """W stashes much larger than inputs (cfp's recomputing backward), limits from the schedule's counts."""
    rng = random.Random(100 + seed)
    for name, entry in SCHEDULES.items():
        p, v = rng.randint(2, 4), entry.default_v
        m = rng.randint(1, 3 * p)
        S = p * v
        kept = KeptBytes(tuple(rng.uniform(.5, 1) for _ in range(S)),
                         tuple(rng.uniform(5, 20) if entry.split else 0.0 for _ in range(S)))
        mine = lambda d: [c for c, x in enumerate(entry.placement.stages(p, v)) if x == d]
        limit = [entry.counts(d, p, m, v)[0] * max(kept.inputs[c] for c in mine(d))
                 + entry.counts(d, p, m, v)[1] * max(kept.weight[c] for c in mine(d)) for d in range(p)]
        table, sim = entry.generated(p, m, _random_costs(rng, entry, p, v), v, limit, kept)
        assert all(k <= x * (1 + 1e-9) for k, x in zip(peak_kept(table, kept), limit)), name
        check_table(table, limit, kept)


def test_a_limit_below_one_micro_batch_is_refused():
    entry = SCHEDULES[ScheduleName.ZB_V]
    with pytest.raises(ConfigError, match="stage 0's memory limit 0.5 is below what one micro-batch keeps there"):
        entry.generated(2, 4, _equal(entry, 2), limit=[0.5, 2.0])


def test_pattern_counts_are_the_closed_forms():
    """`Schedule.counts` (what the planner prices memory by) is what the written-out patterns keep, and bounds
    the generated ones."""
    def counts(t):
        S = t.num_vstages
        ins = peak_kept(t, KeptBytes((1.0,) * S, (0.0,) * S))
        stash = peak_kept(t, KeptBytes((0.0,) * S, (1.0,) * S))
        return [(round(a), round(b)) for a, b in zip(ins, stash)]
    for name, entry in SCHEDULES.items():
        for p, m in itertools.product(range(1, 5), range(1, 9)):
            for v in ((2, 3) if name is ScheduleName.INTERLEAVED else (entry.default_v,)):
                got = counts(entry.pattern(p, m, v))
                want = [entry.counts(s, p, m, v) for s in range(p)]
                if entry.fixed(p, m, v) is not None:
                    assert got == want, (name, p, m, v)
                else:
                    assert all(g[0] <= w[0] and g[1] <= w[1] for g, w in zip(got, want)), (name, p, m, v)


def test_zb_h1_keeps_1f1b_live_micro_batches_and_zb_v_two_half_stages():
    assert live_microbatches(SCHEDULES[ScheduleName.ONE_F_ONE_B].pattern(4, 8)) == [4, 3, 2, 1]
    assert live_microbatches(_zb(4, 8)) == [4, 4, 4, 4]                   # 1F1B's most, on every stage
    zbv = SCHEDULES[ScheduleName.ZB_V].pattern(4, 8)
    assert all(k <= 4 for k in peak_kept(zbv, KeptBytes.units(zbv)))    # p whole-stage micro-batches


# ----------------------------------------------------------------------------- data
def test_placements_and_virtual_stage_layers():
    assert Placement.LOOP.stages(3, 2) == (0, 1, 2, 0, 1, 2)
    assert Placement.V.stages(4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert vstage_layers([3, 2, 2, 1], Placement.V.stages(4, 2)) == (2, 1, 1, 1, 0, 1, 1, 1)
    assert vstage_layers([3, 2, 2, 1], Placement.LOOP.stages(4, 2)) == (2, 1, 1, 1, 1, 1, 1, 0)
    assert SCHEDULES[ScheduleName.ZB_V].head_stage(4) == 0 and SCHEDULES[ScheduleName.INTERLEAVED].head_stage(4) == 3
    with pytest.raises(ConfigError, match="a V placement has two virtual stages per stage, not v=3"):
        Placement.V.stages(4, 3)


def test_schedule_specs_and_one_line_errors():
    assert [str(ScheduleSpec.parse(x)) for x in ("1f1b", "interleaved", "interleaved:3", "zb-v")] == \
        ["1f1b", "interleaved:2", "interleaved:3", "zb-v"]
    assert [str(s) for s in schedule_choices("auto")] == ["1f1b", "interleaved:2", "zb-h1", "zb-v"]
    for text, msg in (("zb", "unknown schedule 'zb'; valid choices: gpipe, 1f1b, interleaved, zb-h1, zb-v"),
                      ("interleaved:1", "interleaved needs v >= 2"), ("zb-v:3", "ZB-V holds exactly 2"),
                      ("interleaved:x", "'x' after ':' is not a number")):
        with pytest.raises(ConfigError, match=msg) as e:
            ScheduleSpec.parse(text)
        assert "\n" not in str(e.value)


def test_runtime_runs_the_validated_patterns():
    for name in ScheduleName:     # virtual stages too (the runtime runs them as stages of their own)
        assert SCHEDULES[name](3, 4) == SCHEDULES[name].pattern(3, 4)
    table = SCHEDULES[ScheduleName.INTERLEAVED](3, 5, 3)      # m not a multiple of p: the generated table
    assert table == SCHEDULES[ScheduleName.INTERLEAVED].pattern(3, 5, 3) and table.v == 3
    assert SCHEDULES[ScheduleName.ZB_V](2, 0).num_vstages == 4      # a pipeline given no micro-batches


def test_equal_time_bubbles():
    """With equal F, B and W: GPipe and 1F1B idle (p-1)/(m+p-1); ZB-H1 fills all but (p-1) F of it with W."""
    p, m = 4, 8
    for name in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B):
        assert SCHEDULES[name].equal_bubble(p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert SCHEDULES[ScheduleName.ZB_H1].equal_bubble(p, m) == pytest.approx((p - 1) / (3 * m + p - 1))


def test_tables_round_trip_as_json_data():
    t = SCHEDULES[ScheduleName.ZB_V].pattern(2, 3)
    assert ScheduleTable.from_dict(t.to_dict()) == t
    with pytest.raises(ConfigError, match="not a schedule table"):
        ScheduleTable.from_dict({"name": "x"})


def test_generate_keeps_the_shortest_of_seeds_and_policies():
    entry = SCHEDULES[ScheduleName.ZB_H1]
    costs = _equal(entry, 3)
    seed = entry.pattern(3, 6)
    table, sim = generate("zb-h1", seed.placement, 6, costs, True, entry.unit_limit(3, 6), seeds=[seed])
    assert sim.makespan == simulate(seed, costs).makespan == entry.theory(3, 6, 1, 1, 1)
