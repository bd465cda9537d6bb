"""Sweep of the planner's estimated step time against the exhaustive optimum (both estimates of the
same cost model) on random small clusters from the tests' generator; prints each gap, the worst, how
many are within 2% and how many clusters passed the exhaustive search's layout cap (skipped).

    PYTHONPATH=$PWD python benchmarks/planner_optimality.py [--seeds 100] [--first 0] [--max-devices 8]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_planner import optimality_gap, random_cluster  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100, help="number of seeds")
    ap.add_argument("--first", type=int, default=0, help="first seed")
    ap.add_argument("--max-devices", type=int, default=8)
    ap.add_argument("--limit", type=int, default=200_000, help="exhaustive search's layout cap")
    args = ap.parse_args()
    gaps: dict[int, float] = {}
    capped = []
    t0 = time.perf_counter()
    for seed in range(args.first, args.first + args.seeds):
        summary = random_cluster(random.Random(seed), args.max_devices).summary()
        gap = optimality_gap(seed, args.max_devices, args.limit)
        if gap is None:
            capped.append(seed)
            print(f"seed {seed:>4}  {summary:<40} passed the cap, skipped", flush=True)
            continue
        gaps[seed] = gap
        print(f"seed {seed:>4}  {summary:<40} gap (estimated) {100 * gap:6.2f}%", flush=True)
    worst = max(gaps, key=gaps.get)
    within = sum(g <= 0.02 for g in gaps.values())
    print(f"\n{len(gaps)} clusters compared, {len(capped)} passed the cap of {args.limit} layouts {capped}")
    print(f"worst gap (estimated step time): {100 * gaps[worst]:.2f}% (seed {worst}); "
          f"within 2%: {within}/{len(gaps)}; sweep time (measured): {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
