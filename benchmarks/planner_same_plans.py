"""Whether a change to the planner changed its plans: every case's layout and every field of its estimate, written
to a JSON file, and compared with the file another checkout wrote (a speed-up must leave both identical).

The cases: issue 40's clusters of four GPU types (1024 GPUs with the schedule choice and per-stage recompute, and
with 1F1B and no recompute; 4096 GPUs), `planner_scale.py`'s 64 and 256 GPUs, and the example clusters under four
schedule and recompute settings. Prints each case's CPU time (measured; a loaded host inflates it).

    PYTHONPATH=/path/to/before python benchmarks/planner_same_plans.py --out before.json
    PYTHONPATH=$PWD python benchmarks/planner_same_plans.py --out after.json --against before.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import planner_scale as scale  # noqa: E402  (this directory's benchmark, for its clusters)

from cfp.models import get_config  # noqa: E402
from cfp.planner.cluster import as_cluster  # noqa: E402
from cfp.planner.options import PlannerOptions  # noqa: E402
from cfp.planner.planner import find_layout  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "clusters")


def _cases() -> dict:
    """name -> (cluster, config, schedule, recompute), built when asked."""
    seven = lambda: get_config("llama2", "7B")
    cases = {
        "1024-auto-auto": (lambda: scale.cluster(1024, scale.PCIE), seven, "auto", "auto"),
        "1024-1f1b-none": (lambda: scale.cluster(1024, scale.PCIE), seven, "1f1b", "none"),
        "4096-auto-auto": (lambda: scale.cluster(4096, scale.PCIE), seven, "auto", "auto"),
        "64-1f1b": (lambda: scale.cluster(64), lambda: get_config("llama2", "13B", dtype="bfloat16"), "1f1b", "auto"),
        "256-auto": (lambda: scale.cluster(256), lambda: get_config("llama2", "70B", dtype="bfloat16"), "auto", "auto"),
    }
    for name in ("paper-llama2-a", "paper-llama2-b", "megatron-4x8-a100-pcie", "local"):
        path = os.path.join(EXAMPLES, name + ".yaml")
        config = (lambda: get_config("llama2", "tiny")) if name == "local" else seven
        for schedule, recompute in (("auto", "auto"), ("1f1b", "selective"), ("gpipe", "full"),
                                    ("interleaved:2", "auto")):
            cases[f"{name}-{schedule}-{recompute}"] = (lambda p=path: as_cluster(p), config, schedule, recompute)
    return cases


def _plan(cluster, config, schedule: str, recompute: str) -> dict:
    options = PlannerOptions(global_batch_size=4 * cluster.num_devices, schedule=schedule, recompute=recompute)
    try:
        r = find_layout(cluster, config, options)
    except Exception as err:        # an infeasible case must stay infeasible, with the same message
        return {"error": repr(err)}
    est = {f.name: repr(getattr(r.estimate, f.name)) for f in dataclasses.fields(r.estimate)}
    return {"layout": r.layout.to_json(), "estimate": est, "candidates": r.candidates}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="write every case's plan here (JSON)")
    ap.add_argument("--against", help="a file another checkout wrote: exit 1 if any case differs")
    ap.add_argument("--only", nargs="+", help="these cases only")
    args = ap.parse_args()
    cases = _cases()
    plans = {}
    for name in args.only or cases:
        cluster, config, schedule, recompute = cases[name]
        cluster = cluster()
        cpu = time.process_time()
        plans[name] = _plan(cluster, config(), schedule, recompute)
        print(f"{name}: {time.process_time() - cpu:.2f} s CPU (measured)", flush=True)
    with open(args.out, "w") as f:
        json.dump(plans, f, indent=0, sort_keys=True)
    if not args.against:
        return 0
    with open(args.against) as f:
        before = json.load(f)
    differ = [n for n in plans if before.get(n) != plans[n]]
    print(f"{len(plans)} cases against {args.against}: " + (f"{len(differ)} differ: {', '.join(differ)}" if differ
                                                              else "every layout and estimate identical"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
