"""Pipeline schedules in the event simulation (`cfp.schedules.simulate`): every figure here is simulated, none timed.

1. Equal stages (p = 4, m = 8; F:B:W = 1:1:1 and 1:2:1, cfp's recomputing backward): each schedule's table
   (written out, or generated from equal times) replayed, its makespan and bubble (the busiest stage's idle
   share) next to its theory (`cfp.schedules.formulas`) and 1F1B's.
2. An uneven heterogeneous pipeline, the shape of issue 27's acceptance run (Llama-2 tiny, 8 layers cut 3/2/2/1,
   the first stage on 2 devices with TP 2, 8 micro-batches of 2 on this machine's `cpu` catalog entry): action
   times estimated by the cost model, the fixed ZB-H1 pattern (written for equal stages) against the tables the
   generator builds from those times.

    PYTHONPATH=$PWD python benchmarks/schedules_sim.py
"""
from __future__ import annotations

from cfp.layout import Pipeline, Stage
from cfp.models import get_config
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel
from cfp.planner.schedule_choice import action_costs
from cfp.schedules.registry import SCHEDULES, ScheduleName, ScheduleSpec
from cfp.schedules.simulate import ActionCosts, simulate

LOCAL = {"inter_machine_bandwidth": "1.75GB/s", "machines": [{"gpu": "cpu", "count": 8,
                                                               "intra_bandwidth": "1.75GB/s"}]}


def equal_stages(p: int = 4, m: int = 8) -> None:
    print(f"equal stages, p={p}, m={m} (simulated from equal unit times; theory: cfp.schedules.formulas)")
    print(f"  {'F:B:W':<8} {'schedule':<14} {'makespan':>9} {'theory':>8} {'bubble':>8} {'/ 1F1B bubble':>14}")
    for fbw in ((1, 1, 1), (1, 2, 1)):
        base = None
        for name, entry in SCHEDULES.items():
            placement = entry.placement.stages(p, entry.default_v)
            costs = ActionCosts.per_stage([fbw[0]] * p, [fbw[1]] * p, [fbw[2]] * p, placement)
            _, sim = entry.generated(p, m, costs)
            base = sim.bubble if name is ScheduleName.ONE_F_ONE_B else base
            ratio = f"{sim.bubble / base:.2f}" if base else "-"
            print(f"  {':'.join(map(str, fbw)):<8} {str(ScheduleSpec(name)):<14} {sim.makespan:>9.2f} "
                  f"{entry.theory(p, m, *fbw):>8.2f} {sim.bubble:>8.1%} {ratio:>14}")


def heterogeneous(m: int = 8) -> None:
    cfg = get_config("llama2", "tiny", num_layers=8)
    cm = CostModel(cfg, parse_cluster(LOCAL), "auto")
    pipe = Pipeline((Stage((0, 1), 3, 0), Stage((2,), 2, 0), Stage((3,), 2, 0), Stage((4,), 1, 0)), 2 * m, m)
    print(f"\nuneven heterogeneous pipeline: TP 2/1/1/1, layers 3/2/2/1, m={m} (simulated from the cost model's "
          "estimated action times)")
    print(f"  {'schedule':<26} {'makespan (ms)':>14} {'bubble':>8} {'imbalance':>10}")
    zb_h1 = ScheduleSpec.parse("zb-h1")
    fixed = simulate(zb_h1.entry.pattern(4, m), action_costs(cm, pipe, 1, zb_h1))
    rows = [("zb-h1 fixed pattern", fixed)]
    for text in ("1f1b", "interleaved:2", "zb-h1", "zb-v"):
        spec = ScheduleSpec.parse(text)
        _, sim = spec.entry.generated(4, m, action_costs(cm, pipe, 1, spec), spec.v)
        rows.append((f"{text} generated", sim))
    for label, sim in rows:
        print(f"  {label:<26} {1e3 * sim.makespan:>14.3f} {sim.bubble:>8.1%} {sim.imbalance:>10.1%}")
    best = min(sim.makespan for label, sim in rows if label.startswith("zb"))
    print(f"  best generated zero-bubble / fixed ZB-H1 pattern: {best / fixed.makespan:.3f}")


if __name__ == "__main__":
    equal_stages()
    heterogeneous()
