"""Phase 2's METIS cut, measured: the planner with and without it (`PlannerOptions.phase2_metis`) on
HexiScale's clusters (`examples/clusters/`, Llama bf16) and the mixed clusters of `planner_scale.py`;
prints the estimated MFU of both, the planner's CPU time (measured) and the step-time ratio.

    PYTHONPATH=$PWD python benchmarks/planner_phase2.py [--sizes 64 256 1024] [--paper N]
"""
from __future__ import annotations

import argparse
import time

import yaml

from cfp.models import get_config
from cfp.planner.cluster import parse_cluster
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import find_layout
from planner_scale import cluster as scale_cluster

PAPER = (("paper-llama2-a.yaml", "7B"), ("paper-llama2-a.yaml", "13B"), ("paper-llama2-b.yaml", "7B"),
         ("paper-llama2-b.yaml", "13B"), ("paper-llama-30b.yaml", "30B"), ("megatron-2x8-a100-pcie.yaml", "13B"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[64, 256, 1024])
    ap.add_argument("--paper", type=int, default=len(PAPER), help="the first N of HexiScale's clusters only")
    args = ap.parse_args()
    if not 0 <= args.paper <= len(PAPER):
        raise SystemExit(f"planner_phase2: --paper {args.paper} must be 0..{len(PAPER)}")
    cases = []
    for path, name in PAPER[:args.paper]:
        with open(f"examples/clusters/{path}") as f:
            cases.append((path, parse_cluster(yaml.safe_load(f)), name))
    cases += [(f"planner_scale {n}", scale_cluster(n), "13B" if n < 128 else "70B") for n in args.sizes]
    print(f"{'cluster':<28} {'model':>5} {'MFU without (est.)':>19} {'with (est.)':>12} {'step with/without':>18} "
          f"{'CPU s without/with (measured)':>30}")
    for label, cl, name in cases:
        cfg = get_config("llama2", name, dtype="bfloat16")
        runs = []
        for on in (False, True):
            t = time.process_time()
            r = find_layout(cl, cfg, PlannerOptions(global_batch_size=4 * cl.num_devices, phase2_metis=on))
            runs.append((r.estimate, time.process_time() - t))
        (a, ta), (b, tb) = runs
        print(f"{label:<28} {name:>5} {100 * a.mfu:>18.2f}% {100 * b.mfu:>11.2f}% {b.step_time / a.step_time:>18.4f} "
              f"{ta:>14.2f} / {tb:<8.2f}", flush=True)


if __name__ == "__main__":
    main()
