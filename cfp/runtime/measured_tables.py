"""A run's measured action times, gathered from every process, and what they give: the table each pipeline runs
next (generated from the measured median F, B and W of each virtual stage, `HeteroTrainer.generated_tables`) and
the simulated replay of a step (each stage owning its compute) beside its fixed pattern and its schedule's formula.

Why generated: a fixed pattern (ZB-H1, ZB-V, interleaved) assumes stages of equal speed; on uneven stages its
slots leave the fast stages idle, where a table built from the measured times fills them with deferred Ws and
forwards, within the activation memory the pattern keeps per device.
"""
from __future__ import annotations

import enum
import time
from typing import Callable, Optional

import jax
import numpy as np

from cfp.runtime.timeline import Event, Timeline, median_action_seconds, replay_measured
from cfp.schedules.actions import KeptBytes, ScheduleTable, peak_kept
from cfp.schedules.formulas import bubble_of
from cfp.schedules.registry import SCHEDULES, Phase, ScheduleSpec
from cfp.schedules.simulate import ActionCosts, Simulation, simulate


class TableSource(str, enum.Enum):
    """Which table a pipeline of an adaptable schedule (`Schedule.adapts`) runs: the schedule's fixed pattern, or a
    table generated from the action times measured before the first step (`generate_from_measured`)."""
    PATTERN = "pattern"
    GENERATED = "generated"


def gather_events(events, n_max: int) -> Timeline:
    """The step's events of every process (each measured its own stages against its own clock, from the same step
    boundary) as one timeline; ``n_max``: the step's number of actions (those not measured: ``unmeasured``).
    A collective: every process calls it at the same step."""
    rows = np.array([[e.pipeline, e.stage, e.microbatch, list(Phase).index(e.phase),
                      e.start, e.end] for e in events], np.float32).reshape(-1, 6)
    if jax.process_count() > 1:
        from cfp.runtime.host_state import process_allgather
        padded = np.full((n_max, 6), -1.0, np.float32)
        padded[:len(rows)] = rows
        rows = np.asarray(process_allgather(padded)).reshape(-1, 6)
        rows = rows[rows[:, 0] >= 0]
    tl = Timeline(unmeasured=n_max - len(rows))
    for row in rows:
        tl.record(int(row[0]), int(row[1]), int(row[2]), list(Phase)[int(row[3])], float(row[4]), float(row[5]))
    return tl


def fastest_of(passes: list[list[Event]]) -> list[Event]:
    """Of several passes' events, each action's shortest: on a host other processes load, a millisecond action
    preempted for a few milliseconds is measured several times its length; the shortest of a few is its own."""
    best: dict[tuple, Event] = {}
    for events in passes:
        for e in events:
            k = (e.pipeline, e.stage, e.microbatch, e.phase)
            if k not in best or e.end - e.start < best[k].end - best[k].start:
                best[k] = e
    return list(best.values())


def measured_alone(trainer, batch, passes: int) -> Optional[list[Event]]:
    """In one process, ``passes`` passes of ``batch`` run one action at a time (`HeteroTrainer.measure` serial),
    each action's shortest (`fastest_of`): every stage here shares the host's cores, so an action timed beside
    others is stretched by them. None under several processes (their actions are timed as they run)."""
    if jax.process_count() > 1:
        return None
    return fastest_of([trainer.measure(batch, serial=True) for _ in range(passes)])


def median_costs(events, pipeline: int, num_vstages: int) -> ActionCosts:
    """Each virtual stage's median measured F, B and W seconds in ``pipeline`` (robust to a shared host's
    stalls)."""
    return ActionCosts(*median_action_seconds([e for e in events if e.pipeline == pipeline], num_vstages))


def generate_from_measured(trainer, batch, log: Callable[[str], None], passes: int = 3) -> bool:
    """Before a run's first step: compile (`HeteroTrainer.warm`), time ``passes`` passes of the schedule on
    ``batch`` without the update (`HeteroTrainer.measure`) and give each pipeline the table generated from its
    measured median F, B and W over all of them (`adopt_generated`: several passes, so that one pass's stalls on a
    shared host do not set the table). A collective under several processes (every process calls it). Returns
    whether tables were adopted."""
    trainer.warm(batch)
    t0 = time.perf_counter()
    events = measured_alone(trainer, batch, passes)
    serial = events is not None
    if not serial:
        events = [e for _ in range(passes) for e in gather_events(trainer.measure(batch), len(trainer.order)).events]
    source = (f"{passes} passes of the first batch without the update"
              f"{' (one action at a time, each action the shortest of them)' if serial else ''} "
              f"({time.perf_counter() - t0:.2f} s measured)")
    if adopt_generated(trainer, events, source, log):
        return True
    log(f"kept the fixed patterns: {passes} measuring passes left some virtual stage's F, B or W "
        "unmeasured (the host was too busy to watch them)")
    return False


def adopt_generated(trainer, events, source: str, log: Callable[[str], None]) -> bool:
    """From measured actions (``events``, every process's; ``source`` says which), give each
    pipeline that ran micro-batches the table generated from its measured medians (`HeteroTrainer.use_tables`);
    log what it is against the fixed pattern on the same times. False (nothing changed) while some virtual stage
    has a kind of action (F, B, W) with no measured time: the medians need one of each, not all."""
    seen = {(e.pipeline, e.stage, e.phase) for e in events}
    # the pipelines whose schedule adapts (GPipe's and 1F1B's order is the schedule itself)
    adapting = [q for q, pipe in enumerate(trainer.layout.pipelines) if pipe.chunks and trainer.spec_of(q).entry.adapts]
    if any((q, a.vstage, a.phase) not in seen for q in adapting for row in trainer.table(q) for a in row):
        return False
    costs = {q: median_costs(events, q, trainer.table(q).num_vstages) for q in adapting}
    generated = trainer.generated_tables(costs)
    trainer.use_tables({q: table for q, (table, _) in generated.items()})
    for q, (table, sim) in generated.items():
        pattern = trainer.pattern(q, table.microbatches)
        fixed = simulate(pattern, costs[q])
        which = "its fixed pattern (the generator found nothing shorter)" if table.actions == pattern.actions else \
            "a table generated"
        log(f"pipeline {q} runs {which} from the median F/B/W of {source}: {sim.makespan:.4f} s, bubble "
            f"{sim.bubble:.1%} (simulated) vs the fixed pattern's {fixed.makespan:.4f} s, bubble {fixed.bubble:.1%} "
            "(simulated), within the activation memory the pattern keeps")
    return True


def simulated_line(spec: ScheduleSpec, tl: Timeline, q: int, v: dict, table: ScheduleTable,
                   kept: Optional[KeptBytes] = None) -> tuple[str, Simulation]:
    """Pipeline q's measured actions replayed on the ``table`` it ran with every stage owning its compute
    (`replay_measured`), the same with each stage's median measured F, B and W (a shared host stalls a few actions
    for far longer than they compute), the fixed pattern on those medians where another table ran, the schedule's
    time formula on them (`cfp.schedules.formulas`) and the shortest table generated from them within the memory
    the fixed pattern keeps (``kept``: each virtual stage's bytes per micro-batch; default one unit per whole
    stage's micro-batch). Returns the line and the replay."""
    entry = SCHEDULES[spec.name]
    p, m = v["stages"], v["microbatches"]
    events = [e for e in tl.events if e.pipeline == q]   # an event's stage is its virtual stage
    raw = replay_measured(events, table)
    costs = median_costs(tl.events, q, table.num_vstages)
    med = simulate(table, costs)
    f, b, w = ([sum(x for x, d in zip(xs, table.placement) if d == s) for s in range(p)]
               for xs in (costs.fwd, costs.bwd_input, costs.bwd_weight))
    theory = entry.seconds(f, b, w, m, spec.v)
    busiest = max(x + y + z for x, y, z in zip(f, b, w))
    pattern = entry.pattern(p, m, spec.v)
    ran = "its fixed pattern" if table.actions == pattern.actions else "a generated table"
    if table.actions == pattern.actions:
        fixed = ""
    else:
        alt = simulate(pattern, costs)
        fixed = f"; the fixed pattern on those medians: {alt.makespan:.4f} s, bubble {alt.bubble:.1%} (simulated)"
    # what the generator makes of the measured medians, within the memory the fixed pattern keeps
    limit = None if kept is None else peak_kept(pattern, kept)
    gen_table, gen = entry.generated(p, m, costs, spec.v, limit, kept)
    which = "the fixed pattern" if gen_table.actions == pattern.actions else "a generated table"
    return (f"pipeline {q} ran {ran}: simulated from the measured action times (each stage owning its compute): "
            f"makespan {raw.makespan:.4f} s, bubble {raw.bubble:.1%} (the busiest stage idle), imbalance "
            f"{raw.imbalance:.1%}; with each stage's median F/B/W: {med.makespan:.4f} s, bubble {med.bubble:.1%}, "
            f"imbalance {med.imbalance:.1%}{fixed}; {spec}'s formula on those medians: {theory:.4f} s, bubble "
            f"{bubble_of(theory, m, busiest):.1%} (estimated); the shortest {spec} table generated from those "
            f"medians ({which}): {gen.makespan:.4f} s, bubble {gen.bubble:.1%} (simulated)"), raw


def replay_timeline(sims: dict[int, Simulation]) -> Timeline:
    """Per pipeline its replay (`simulated_line`) as a timeline: what the measured actions take when every stage
    owns its compute, to draw beside the measured one."""
    out = Timeline()
    for q, sim in sims.items():
        for sp in sim.spans:
            if sp.end > sp.start:     # an action measured at no time draws nothing
                out.record(q, sp.vstage, sp.microbatch, sp.phase, sp.start, sp.end)
    return out
