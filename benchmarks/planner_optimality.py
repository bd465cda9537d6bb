"""Sweep of the planner's estimated step time against the exhaustive optimum (both estimates of the
same cost model) on the random small clusters of `cfp.planner.random_clusters`; prints each gap, the
worst and mean, how many are within 2% and how many clusters passed the exhaustive search's layout cap
(skipped). A planner estimate below the optimum would mean the two searched different spaces: reported.

    PYTHONPATH=$PWD python benchmarks/planner_optimality.py [--seeds 100] [--first 0] [--max-devices 8]
        [--limit 200000] [--only SEED ...]
"""
from __future__ import annotations

import argparse
import time

from cfp.planner.random_clusters import optimality_case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100, help="number of seeds")
    ap.add_argument("--first", type=int, default=0, help="first seed")
    ap.add_argument("--max-devices", type=int, default=8)
    ap.add_argument("--limit", type=int, default=200_000, help="exhaustive search's layout cap")
    ap.add_argument("--only", type=int, nargs="+", default=None,
                    help="these seeds instead of --first/--seeds (e.g. the ones that passed a smaller cap)")
    args = ap.parse_args()
    gaps: dict[int, float] = {}
    capped, below, plan_s = [], [], []
    t0 = time.perf_counter()
    for seed in args.only or range(args.first, args.first + args.seeds):
        case = optimality_case(seed, args.max_devices, args.limit)
        summary = case.cluster.summary()
        plan_s.append(case.planned.seconds)
        if case.gap is None:
            capped.append(seed)
            print(f"seed {seed:>4}  {summary:<48} passed the cap, skipped", flush=True)
            continue
        gaps[seed] = case.gap
        used = sorted(d for p in case.planned.layout.pipelines for s in p.stages for d in s.devices)
        if case.gap < -1e-9 or used != list(range(case.cluster.num_devices)):
            below.append(seed)
        print(f"seed {seed:>4}  {summary:<48} gap (estimated) {100 * case.gap:6.2f}%  "
              f"planning {case.planned.seconds:5.2f} s (measured)", flush=True)
    worst = max(gaps, key=gaps.get)
    within = sum(g <= 0.02 for g in gaps.values())
    print(f"\n{len(gaps)} clusters compared, {len(capped)} passed the cap of {args.limit} layouts {capped}")
    print(f"worst gap (estimated step time): {100 * gaps[worst]:.2f}% (seed {worst}); mean "
          f"{100 * sum(gaps.values()) / len(gaps):.3f}%; within 2%: {within}/{len(gaps)}; below the "
          f"optimum or not using every device once (a bug): {below}")
    print(f"planning time (measured): mean {sum(plan_s) / len(plan_s):.3f} s, max {max(plan_s):.3f} s; "
          f"sweep time (measured): {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
