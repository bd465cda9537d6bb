"""The planner's estimated step time against the measured one, for the layout it picks on this machine and
others, on `examples/clusters/local.yaml` (8 simulated XLA:CPU devices).

The planner plans the model (`find_layout`, as `cfp plan` does); beside its pick come Megatron-style uniform
layouts (pure data parallel, one pipeline of 8 stages, tensor-parallel groups) and the greedy heuristic of
`cfp plan --compare`, all at the same global batch. Each is estimated by the planner's cost model and run by
the runtime (`HeteroTrainer`: its compiled stage programs, one optimizer step per layout per round, the
layouts in turns so that a busy spell of the shared host falls on all alike, after a warm-up step). Prints
per layout the estimated and the measured (median) step time and their ratio, the ranking by each, and
`worst estimate/measured ratio: R` (the ratio furthest from 1).

    PYTHONPATH=$PWD python benchmarks/planner_measured.py [--model llama2 --config small --num-layers 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import yaml  # noqa: E402

from cfp.models import get_config  # noqa: E402
from cfp.planner.baselines import _megatron, greedy_layout  # noqa: E402
from cfp.planner.cluster import parse_cluster  # noqa: E402
from cfp.planner.costmodel import CostModel  # noqa: E402
from cfp.planner.options import PlannerOptions  # noqa: E402
from cfp.planner.planner import find_layout  # noqa: E402

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "clusters", "local.yaml")


def candidates(cm, options) -> list[tuple[str, object]]:
    """(name, layout): the planner's pick, then other layouts of the same global batch (distinct ones)."""
    out = [("planner", find_layout(cm.cluster, cm.config, options).layout)]
    b = options.global_batch_size
    for name, (t, p, d, mb) in (("data parallel 8", (1, 1, 8, b // 8)), ("2 pipelines x 4 stages", (1, 4, 2, 2)),
                                ("1 pipeline x 8 stages", (1, 8, 1, 2)), ("4 x TP 2", (2, 1, 4, b // 4)),
                                ("2 x TP 4", (4, 1, 2, b // 2))):
        lay = _megatron(cm, t, p, d, b, mb)
        if lay is not None:
            out.append((name, lay))
    greedy = greedy_layout(cm, options)
    if greedy is not None:
        out.append(("greedy", greedy[0]))
    seen, unique = set(), []
    for name, lay in out:
        if lay not in seen:
            seen.add(lay)
            unique.append((name, lay))
    return unique


def measure(model: str, cfg, layouts, rounds: int, log) -> list[list[float]]:
    """Step seconds of each layout per round (the layouts in turns), after a warm-up step each."""
    from cfp.runtime.engine import HeteroTrainer
    from cfp.runtime.schedules import ScheduleName
    trainers = []
    for name, lay in layouts:
        t0 = time.perf_counter()
        tr = HeteroTrainer(model, cfg, lay).init(0)
        tr.set_schedule(ScheduleName.ONE_F_ONE_B)
        tr.compile()
        trainers.append(tr)
        log(f"  compiled {name}: {time.perf_counter() - t0:.1f} s (measured)")
    batch = _batch(model, cfg, layouts[0][1].global_batch)
    for tr in trainers:
        tr.step(batch)                                   # warm-up
    times = [[] for _ in trainers]
    for r in range(rounds):
        for i, tr in enumerate(trainers):
            times[i].append(tr.step(batch).seconds)
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{t[-1]:.3f}" for t in times) + " s (measured)")
    return times


def _batch(model: str, cfg, rows: int) -> dict:
    import jax
    import numpy as np

    from cfp.models import make_batch
    return jax.tree_util.tree_map(np.asarray, make_batch(model, cfg, rows, jax.random.PRNGKey(0)))


def calibrated_cluster(cluster, repeats: int):
    """`cluster` with its `cpu` devices and links as measured now (`calibrate_cpu.py`): the host's load
    changes from hour to hour, so the figures the estimates use are measured beside the steps they predict."""
    import dataclasses

    import jax
    import numpy as np
    from jax.sharding import Mesh

    import calibrate_cpu as cal
    mesh = Mesh(np.array(jax.devices()), ("d",))
    gemm, mem = cal.gemm_rate(mesh, 512, repeats), cal.memory_bandwidth(mesh, 4 << 20, repeats)
    points = [(n, b, cal.all_reduce_time(n, b, repeats)) for n in (2, 4, 8) for b in (1 << 16, 1 << 20, 1 << 22)]
    _, link = cal.fit_link(points)
    print(f"calibrated now (measured): GEMM {gemm / 1e9:.2f} GFLOP/s, memory {mem / 1e9:.2f} GB/s per device, "
          f"all-reduce bandwidth {link / 1e9:.2f} GB/s", flush=True)
    machines = []
    for m in cluster.machines:
        gpu = dataclasses.replace(m.gpu, tflops=tuple((p, gemm / 1e12) for p, _ in m.gpu.tflops),
                                  mem_gbps=mem / 1e9, link_gbps=link / 1e9)
        machines.append(dataclasses.replace(m, gpu=gpu, intra_bandwidth=link))
    return dataclasses.replace(cluster, machines=tuple(machines), inter_bandwidth=link)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2")
    ap.add_argument("--config", default="small")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calibrate", action="store_true",
                    help="plan and estimate with the cpu figures measured now (calibrate_cpu.py) instead of the "
                         "catalog's")
    args = ap.parse_args()
    with open(CLUSTER) as f:
        cluster = parse_cluster(yaml.safe_load(f))
    if args.calibrate:
        cluster = calibrated_cluster(cluster, 5)
    cfg = get_config(args.model, args.config, num_layers=args.num_layers)
    options = PlannerOptions(global_batch_size=args.global_batch_size)
    cm = CostModel(cfg, cluster, options.schedule)
    layouts = candidates(cm, options)
    est = [cm.estimate(lay).step_time for _, lay in layouts]
    print(f"{args.model} {args.config} ({cfg.num_layers} layers, seq {cfg.seq_len}, {cfg.dtype}), global batch "
          f"{args.global_batch_size}, schedule 1f1b, on {cluster.summary()}; host load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    times = measure(args.model, cfg, layouts, args.rounds, lambda s: print(s, flush=True))
    med = [statistics.median(t) for t in times]
    print(f"{'layout':<24} {'estimated step (s)':>18} {'measured step (s)':>18} {'noise':>6} {'est/meas':>8}  shape")
    ratios = []
    for (name, lay), e, m, t in zip(layouts, est, med, times):
        noise = (max(t) - min(t)) / 2 / m
        ratios.append(e / m)
        print(f"{name:<24} {e:>18.4f} {m:>18.4f} {noise:>6.1%} {e / m:>8.2f}  {lay.summary()}")
    by_est = [layouts[i][0] for i in sorted(range(len(est)), key=est.__getitem__)]
    by_meas = [layouts[i][0] for i in sorted(range(len(med)), key=med.__getitem__)]
    print(f"ranking by estimate: {' < '.join(by_est)}")
    print(f"ranking by measured: {' < '.join(by_meas)}  ({'same order' if by_est == by_meas else 'differs'})")
    worst = max(ratios, key=lambda r: max(r, 1 / r))
    print(f"worst estimate/measured ratio: {worst:.2f}")


if __name__ == "__main__":
    main()
