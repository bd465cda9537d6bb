"""Planning time of `cfp plan`'s planner for 64, 256 and 1024 mixed devices (measured).

Each cluster has equal numbers of 8-device machines of four types (RTX 3090, RTX 4090, A100-SXM-80G,
H100-SXM), PCIe 25 GB/s inside the consumer machines, NVLink inside the data-centre ones, 12.5 GB/s
between machines; the model is Llama-2 70B in bfloat16 (13B for 64 devices, whose memory cannot hold
70B's AdamW state), global batch 4 sequences per device. Prints wall and CPU time (the planner is
single-threaded: on an idle host they agree; on a shared one the wall time includes waiting for a core).

    PYTHONPATH=$PWD python benchmarks/planner_scale.py [--sizes 64 256 1024]
"""
from __future__ import annotations

import argparse
import os
import time

from cfp.models import get_config
from cfp.planner.cluster import parse_cluster
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import find_layout

TYPES = (("RTX3090", "25GB/s"), ("RTX4090", "25GB/s"), ("A100-SXM-80G", "300GB/s"), ("H100-SXM", "450GB/s"))


def cluster(n: int):
    per_type = n // 8 // len(TYPES)
    return parse_cluster({"inter_machine_bandwidth": "12.5GB/s", "machines": [
        {"gpu": g, "count": 8, "intra_bandwidth": bw, "repeat": per_type} for g, bw in TYPES]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    args = ap.parse_args()
    print(f"{'devices':>8} {'model':>6} {'pipelines':>9} {'stages':>7} {'candidates':>10} "
          f"{'est. MFU':>9} {'planning time (measured)':>25} {'CPU time (measured)':>20}")
    for n in args.sizes:
        cl = cluster(n)
        name = "13B" if n < 128 else "70B"
        cfg = get_config("llama2", name, dtype="bfloat16")
        cpu = time.process_time()
        r = find_layout(cl, cfg, PlannerOptions(global_batch_size=4 * n))
        cpu = time.process_time() - cpu
        stages = sum(len(p.stages) for p in r.layout.pipelines)
        print(f"{cl.num_devices:>8} {name:>6} {len(r.layout.pipelines):>9} {stages:>7} {r.candidates:>10} "
              f"{100 * r.estimate.mfu:>8.2f}% {r.seconds:>23.2f} s {cpu:>18.2f} s", flush=True)
    # wall time includes waiting for a core on a shared host; the CPU time does not
    print(f"host load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
