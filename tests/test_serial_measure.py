"""Action times measured one at a time (issue 38 item 6): every stage of a process shares the host's cores, so an
action timed beside others is stretched by them -- the more, the fewer bubbles its schedule leaves. A serial pass
(`HeteroTrainer.measure(batch, serial=True)`) dispatches each action only after the one before it ended, so each
measured interval is the action's own; the simulated makespans and the adapting schedules' tables use each
action's shortest of a few such passes (`fastest_of`: another process preempting a millisecond action lengthens
it several times)."""
import itertools

import jax
import numpy as np

from cfp.layout import Layout
from cfp.runtime.engine import HeteroTrainer
from cfp.schedules.registry import Phase

from test_runtime import batches, programs, tiny

LAYOUT = Layout.from_lists([[1, 1, 1]], [[1, 1, 1]], [6], [6])


def _trainer(schedule):
    cfg = tiny(3)
    cache = programs(cfg)
    return HeteroTrainer(cache.model, None, LAYOUT, schedule, cache=cache).init(), cfg


def test_a_serial_pass_times_each_action_alone_and_changes_nothing():
    trainer, cfg = _trainer("zb-h1")
    batch = batches("llama2", cfg, LAYOUT.global_batch)[0]
    trainer.measure(batch)                   # compiles every program (a first call's compile is no action's time)
    before = jax.tree_util.tree_map(np.asarray, trainer.state()[0])
    clock, last, unready = trainer._clock, [], []
    dispatched, alone = clock.dispatched, clock.alone

    def watch_dispatch(key, microbatch, phase, t0, done):
        last[:] = [done]
        return dispatched(key, microbatch, phase, t0, done)

    def watch_alone(key, microbatch, phase, end):   # its end is taken once its outputs are there
        unready.extend(a for a in jax.tree_util.tree_leaves(last) if not a.is_ready())
        return alone(key, microbatch, phase, end)

    clock.dispatched, clock.alone = watch_dispatch, watch_alone
    try:
        events = trainer.measure(batch, serial=True)
    finally:
        del clock.dispatched, clock.alone
    assert not unready
    # every action of the pass measured once: F, B and W of each micro-batch on each stage
    kinds = {(e.stage, e.microbatch, e.phase) for e in events}
    assert len(events) == len(kinds) == 3 * 6 * 3
    assert {e.phase for e in events} == {Phase.FWD, Phase.BWD_INPUT, Phase.BWD_WEIGHT}
    # one at a time: no two intervals overlap, whatever stage they ran on
    spans = sorted((e.start, e.end) for e in events)
    assert all(e > s for s, e in spans)
    for (s0, e0), (s1, e1) in itertools.pairwise(spans):
        assert e0 <= s1, ((s0, e0), (s1, e1))
    after = jax.tree_util.tree_map(np.asarray, trainer.state()[0])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                     jax.tree_util.tree_leaves(after)))


def test_a_run_simulates_its_makespan_from_actions_measured_one_at_a_time():
    from cfp.runtime.training import TrainOptions, run_training
    lines = []
    opts = TrainOptions(model="llama2", config_name="tiny", layout=LAYOUT, overrides={"num_layers": 3},
                        schedule="zb-h1", steps=3, recompute="none")
    r = run_training(opts, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    said = [line for line in lines if "makespan" in line and "measured one at a time" in line]
    assert len(said) == 1 and r.median_makespan[0] > 0
    # the adapting schedule's table came from serial passes too
    assert any("one action at a time" in line for line in lines if "runs" in line)


def test_each_actions_shortest_of_several_passes():
    from cfp.runtime.measured_tables import fastest_of
    from cfp.runtime.timeline import Event
    a = [Event(0, 0, 0, Phase.FWD, 0.0, 5.0), Event(0, 1, 0, Phase.FWD, 5.0, 6.0)]
    b = [Event(0, 0, 0, Phase.FWD, 0.0, 1.0), Event(0, 1, 0, Phase.FWD, 1.0, 9.0)]
    got = sorted(fastest_of([a, b]), key=lambda e: e.stage)
    assert [(e.start, e.end) for e in got] == [(0.0, 1.0), (5.0, 6.0)]
