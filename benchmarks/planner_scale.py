"""Planning time of `cfp plan`'s planner for mixed clusters of 64 to 4096 devices (measured), and each plan beside
the previous size's plan replicated onto it (estimated).

Each cluster has equal numbers of 8-device machines of four types (RTX 3090, RTX 4090, A100 -- SXM 80 GB, or with
``--a100 pcie`` the PCIe 40 GB of issue 40's clusters -- and H100-SXM), PCIe 25 GB/s inside the consumer machines
(32 GB/s the A100-PCIe ones), NVLink inside the SXM ones, 12.5 GB/s between machines; the model is Llama-2 70B in
bfloat16 (13B for 64 devices, whose memory cannot hold 70B's AdamW state) or ``--model`` (e.g. 7B, in its config's
own dtype as `cfp plan` prices it), global batch 4 sequences per device, ``--schedule`` (default 1f1b; auto: each
pipeline's fastest fitting schedule) and ``--recompute`` (default auto). Prints CPU time (the planner is
single-threaded; on a shared host the wall time includes waiting for a core) and, from the second size on, the
previous size's layout copied onto each of the larger cluster's like sub-clusters (``replicated``: step time at the
larger global batch, the same cost model) -- a plan at least as fast is the bar at scale.

    PYTHONPATH=$PWD python benchmarks/planner_scale.py [--sizes 64 256 1024] [--a100 pcie] [--model 7B]
"""
from __future__ import annotations

import argparse
import os
import time

from cfp.layout import Layout, Pipeline, Stage
from cfp.models import get_config
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import find_layout

TYPES = (("RTX3090", "25GB/s"), ("RTX4090", "25GB/s"), ("A100-SXM-80G", "300GB/s"), ("H100-SXM", "450GB/s"))
PCIE = (("RTX3090", "25GB/s"), ("RTX4090", "25GB/s"), ("A100-PCIe-40G", "32GB/s"), ("H100-SXM", "450GB/s"))


def cluster(n: int, types=TYPES):
    per_type = n // 8 // len(types)
    return parse_cluster({"inter_machine_bandwidth": "12.5GB/s", "machines": [
        {"gpu": g, "count": 8, "intra_bandwidth": bw, "repeat": per_type} for g, bw in types]})


def replicated(layout: Layout, small: int, big: int, types) -> Layout:
    """`layout` (planned for `cluster(small)`) copied onto each of `cluster(big)`'s big/small like sub-clusters:
    machine j of a type in copy c is machine c * (small's per-type count) + j of that type."""
    ps, pb = small // 8 // len(types), big // 8 // len(types)
    pipes = []
    for c in range(big // small):
        for p in layout.pipelines:
            stages = []
            for s in p.stages:
                t, j = divmod(s.machine, ps)
                m = t * pb + c * ps + j
                stages.append(Stage(tuple(d + 8 * (m - s.machine) for d in s.devices), s.layers, m))
            pipes.append(Pipeline(tuple(stages), p.batch, p.chunks))
    return Layout(tuple(pipes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--a100", choices=("sxm", "pcie"), default="sxm")
    ap.add_argument("--model", default=None, help="Llama-2 config (default: 13B below 128 devices, else 70B; bf16)")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--recompute", default="auto")
    args = ap.parse_args()
    types = PCIE if args.a100 == "pcie" else TYPES
    print(f"{'devices':>8} {'model':>6} {'pipelines':>9} {'stages':>7} {'candidates':>10} {'est. MFU':>9} "
          f"{'est. step':>10} {'CPU time (measured)':>20} {'previous plan replicated (est.)':>32}")
    prev = None
    for n in args.sizes:
        cl = cluster(n, types)
        name = args.model or ("13B" if n < 128 else "70B")
        cfg = get_config("llama2", name) if args.model else get_config("llama2", name, dtype="bfloat16")
        options = PlannerOptions(global_batch_size=4 * n, schedule=args.schedule, recompute=args.recompute)
        cpu = time.process_time()
        r = find_layout(cl, cfg, options)
        cpu = time.process_time() - cpu
        stages = sum(len(p.stages) for p in r.layout.pipelines)
        rep = ""
        if prev is not None and prev[1] == name and n % prev[0] == 0 and n > prev[0]:
            cm = CostModel(cfg, cl, options.schedule, features=options.features)
            e = cm.estimate(replicated(prev[2], prev[0], n, types))
            rep = (f"{e.step_time:.3f} s ({r.estimate.step_time / e.step_time:.2f}x it)" if e.fits
                   else "does not fit")
        print(f"{cl.num_devices:>8} {name:>6} {len(r.layout.pipelines):>9} {stages:>7} {r.candidates:>10} "
              f"{100 * r.estimate.mfu:>8.2f}% {r.estimate.step_time:>8.3f} s {cpu:>18.2f} s {rep:>32}", flush=True)
        prev = (n, name, r.layout)
    print(f"host load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
