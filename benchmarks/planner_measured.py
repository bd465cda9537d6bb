"""The planner's estimated step time against the measured one, for the layout it picks on this machine and
others, on `examples/clusters/local.yaml` (8 simulated XLA:CPU devices).

The planner plans the model (`find_layout`, as `cfp plan` does); beside its pick come Megatron-style uniform
layouts (pure data parallel, one pipeline of 8 stages, tensor-parallel groups) and the greedy heuristic of
`cfp plan --compare`, all at the same global batch. Each is estimated by the planner's cost model and run by
the runtime (`HeteroTrainer`: its compiled stage programs, one optimizer step per layout per round, the
layouts in turns so that a busy spell of the shared host falls on all alike, after a warm-up step).

The `cpu` devices are priced by this host's measured entry (`cfp.hardware.host_entry`: measured on first use,
cached per host; `--recalibrate` measures again; the catalog's entry where measurement is off or fails), which
describes the host's cores as this process has them when no one else loads the host; on a shared host the process gets fewer. So before each step a reference
program (a GEMM on every device) measures the cores the host gives now (its CPU time over its wall time), and
the estimate at that share is the idle-host one times cores / share -- one factor for all layouts, which leaves
the ranking as it is. Prints per layout that estimate and the measured (median) wall step time and their
ratio; the idle-host estimate beside the step's measured CPU time (all threads) over the host's cores;
the ranking by each, `rank order estimated vs measured: same/different` with each pair the two order
differently and whether their measured medians differ by more than the runs' spread (half the range of the
middle three), and `worst estimate/measured ratio: R` (the ratio furthest from 1).

    PYTHONPATH=$PWD python benchmarks/planner_measured.py [--model llama2 --config small --num-layers 8]
        [--global-batch-size 16] [--rounds 5] [--max-layouts N]
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

from cfp.hardware.host_entry import host_figures  # noqa: E402
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
                                ("1 pipeline x 8 stages", (1, 8, 1, 2)),
                                ("8 stages, micro-batch 8", (1, 8, 1, 8)), ("4 x TP 2", (2, 1, 4, b // 4)),
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


def measure(model: str, cfg, layouts, rounds: int, log) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Per layout and round (the layouts in turns, after a warm-up step each): the step's wall seconds and CPU
    seconds (all the process's threads); and per round and layout, the cores the host gave a reference
    program measured just before the step (`host_share`)."""
    from cfp.runtime.engine import zoo_trainer
    from cfp.schedules.registry import ScheduleName
    trainers = []
    for name, lay in layouts:
        t0 = time.perf_counter()
        tr = zoo_trainer(model, cfg, lay, example_batch=_batch(model, cfg, 1)).init()
        tr.set_schedule(ScheduleName.ONE_F_ONE_B)
        tr.compile()
        trainers.append(tr)
        log(f"  compiled {name}: {time.perf_counter() - t0:.1f} s (measured)")
    batch = _batch(model, cfg, layouts[0][1].global_batch)
    for tr in trainers:
        tr.step(batch)                                   # warm-up
    reference = _reference()
    wall, cpu, share = [[] for _ in trainers], [[] for _ in trainers], []
    for r in range(rounds):
        for i, tr in enumerate(trainers):
            share.append(host_share(reference))
            c0 = time.process_time()
            wall[i].append(tr.step(batch).seconds)
            cpu[i].append(time.process_time() - c0)
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{w[-1]:.3f}/{c[-1]:.3f}" for w, c in zip(wall, cpu))
            + f" s wall/CPU; host share {statistics.median(share[-len(trainers):]):.2f} cores (measured)")
    return wall, cpu, share


def _reference():
    """A float32 512x512 GEMM on every device at once: work that can keep every core busy."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.device_put(np.ones((mesh.devices.size, 512, 512), np.float32), NamedSharding(mesh, P("d")))
    f = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a))
    jax.block_until_ready(f(x))
    return f, x


def host_share(reference) -> float:
    """Cores the host gives this process now: CPU seconds over wall seconds of the reference program (3 runs)."""
    import jax
    f, x = reference
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(f(x))
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def _batch(model: str, cfg, rows: int) -> dict:
    import jax
    import numpy as np

    from cfp.models import make_batch
    return jax.tree_util.tree_map(np.asarray, make_batch(model, cfg, rows, jax.random.PRNGKey(0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2")
    ap.add_argument("--config", default="small")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--recalibrate", action="store_true", help="measure this host's devices again (else cached)")
    ap.add_argument("--max-layouts", type=int, default=None,
                    help="time the planner's pick and the first N-1 other layouts only (default: all)")
    args = ap.parse_args()
    with open(CLUSTER) as f:
        cluster = parse_cluster(yaml.safe_load(f))
    # this host's measured entry (measured on first use, cached per host), else the catalog's, named
    figures = host_figures(args.recalibrate, log=lambda s: print(s, flush=True))
    cluster = cluster.with_device(figures.spec)
    cfg = get_config(args.model, args.config, num_layers=args.num_layers)
    options = PlannerOptions(global_batch_size=args.global_batch_size)
    cm = CostModel(cfg, cluster, options.schedule)
    layouts = candidates(cm, options)[:args.max_layouts]
    est = [cm.estimate(lay).step_time for _, lay in layouts]
    print(f"{args.model} {args.config} ({cfg.num_layers} layers, seq {cfg.seq_len}, {cfg.dtype}), global batch "
          f"{args.global_batch_size}, schedule 1f1b, on {cluster.summary()}; host load average "
          f"{os.getloadavg()[0]:.1f} on {figures.calibration.cores} cores; figures: {figures.describe()}", flush=True)
    wall, cpu, share = measure(args.model, cfg, layouts, args.rounds, lambda s: print(s, flush=True))
    report(layouts, est, wall, cpu, statistics.median(share), figures.calibration.cores)


def report(layouts, est, wall, cpu, cores_now: float, cores: int) -> None:
    """The table (estimated at the host's measured share, against measured wall time), the rankings and the
    worst ratio; beside it the idle-host estimate (all `cores` the figures were measured with) against the
    measured CPU time over those cores."""
    scale = cores / cores_now
    print(f"host share during the steps: {cores_now:.2f} of {cores} cores (measured, median); the estimates "
          f"below at that share are the idle-host ones (all {cores} cores) x {scale:.2f}")
    print(f"{'layout':<24} {'est. step (s)':>13} {'meas. wall (s)':>14} {'noise':>6} {'est/meas':>8} "
          f"{'est. idle (s)':>13} {'meas. CPU/cores (s)':>19} {'est/meas':>8}  shape")
    ratios, med, spread = [], [], []
    for (name, lay), e, w, c in zip(layouts, est, wall, cpu):
        m, mc = statistics.median(w), statistics.median(c) / cores
        noise = (max(w) - min(w)) / 2 / m
        ratios.append(e * scale / m)
        med.append(m)
        spread.append(_middle_spread(w))
        print(f"{name:<24} {e * scale:>13.4f} {m:>14.4f} {noise:>6.1%} {e * scale / m:>8.2f} {e:>13.4f} {mc:>19.4f} "
              f"{e / mc:>8.2f}  {lay.summary()}")
    by_est = [layouts[i][0] for i in sorted(range(len(est)), key=est.__getitem__)]
    by_meas = [layouts[i][0] for i in sorted(range(len(med)), key=med.__getitem__)]
    print(f"ranking by estimate: {' < '.join(by_est)}")
    print(f"ranking by measured: {' < '.join(by_meas)}")
    swaps = swapped_pairs(est, med, spread)
    real = sum(beyond for *_, beyond in swaps)
    print(f"rank order estimated vs measured: {'same' if by_est == by_meas else 'different'}"
          + (f" ({len(swaps)} pair(s) swapped, {real} by more than the measured spread)" if swaps else ""))
    for i, j, beyond in swaps:
        print(f"  swapped: {layouts[i][0]} (est. {est[i] * scale:.3f} s, meas. {med[i]:.3f} ± {spread[i]:.3f} s) "
              f"vs {layouts[j][0]} (est. {est[j] * scale:.3f} s, meas. {med[j]:.3f} ± {spread[j]:.3f} s): "
              f"{'beyond' if beyond else 'within'} the measured spread")
    worst = max(ratios, key=lambda r: max(r, 1 / r))
    print(f"planner's pick: estimate/measured ratio {ratios[0]:.2f}")
    print(f"worst estimate/measured ratio: {worst:.2f}")


def _middle_spread(samples) -> float:
    """Half the range of the middle three of `samples` (seconds): the spread the median is known to."""
    t = sorted(samples)
    mid = t[max(len(t) // 2 - 1, 0): len(t) // 2 + 2]
    return (mid[-1] - mid[0]) / 2


def swapped_pairs(est, med, spread) -> list[tuple[int, int, bool]]:
    """(i, j, beyond): layouts the estimate orders i before j and the measured medians the other way round;
    `beyond` when the medians differ by more than their two spreads together (a swap the noise does not
    explain)."""
    out = []
    for i in range(len(est)):
        for j in range(len(est)):
            if est[i] < est[j] and med[i] > med[j]:
                out.append((i, j, med[i] - med[j] > spread[i] + spread[j]))
    return out


if __name__ == "__main__":
    main()
