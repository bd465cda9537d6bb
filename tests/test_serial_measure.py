"""Action times measured one at a time (issue 38 item 6): every stage of a process shares the host's cores, so an
action timed beside others is stretched by them -- the more, the fewer bubbles its schedule leaves. A serial pass
(`HeteroTrainer.measure(batch, serial=True)`) dispatches each action only after the one before it ended, so each
measured time is the action's own: the process's CPU time it took, which neither the process's other stages nor
other processes lengthen. The simulated makespans and the adapting schedules' tables use those."""
import itertools
import time

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

    def watch_alone(key, microbatch, phase, seconds):   # its time is taken once its outputs are there
        unready.extend(a for a in jax.tree_util.tree_leaves(last) if not a.is_ready())
        return alone(key, microbatch, phase, seconds)

    clock.dispatched, clock.alone = watch_dispatch, watch_alone
    cpu = time.process_time()
    try:
        events = trainer.measure(batch, serial=True)
    finally:
        del clock.dispatched, clock.alone
    cpu = time.process_time() - cpu
    assert not unready
    # every action of the pass measured once: F, B and W of each micro-batch on each stage
    kinds = {(e.stage, e.microbatch, e.phase) for e in events}
    assert len(events) == len(kinds) == 3 * 6 * 3
    assert {e.phase for e in events} == {Phase.FWD, Phase.BWD_INPUT, Phase.BWD_WEIGHT}
    # each action's time is the CPU time it took alone, dispatch to end: together nearly all of the pass's CPU
    # (the rest: the bookkeeping between actions); dispatched without waiting, an action's CPU time until the next
    # dispatch would be its dispatch alone, the computing left to the threads behind it
    took = sum(e.end - e.start for e in events)
    assert all(e.end > e.start for e in events)
    assert 0.6 * cpu <= took <= cpu * (1 + 1e-6), (took, cpu)
    # one at a time: each action dispatched after the one before it was waited for
    starts = sorted(e.start for e in events)
    assert all(b > a for a, b in itertools.pairwise(starts))
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
