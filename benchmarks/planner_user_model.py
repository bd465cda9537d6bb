"""The planner's estimated step time for a user's model -- a `cfp.LayeredModel` from a ``--model`` factory, priced by
the cost facts derived from its own traced and compiled parts (`cfp.layered.derive`) -- against the step time
measured training it with `cfp.train_pipelines`, on `examples/clusters/local.yaml` (8 simulated XLA:CPU devices).

The planner plans the model (`cfp.plan_layout`'s path: facts, then `find_layout`); beside its pick come the
layouts `--layouts` names among the Megatron-style uniform ones and the greedy heuristic of
`benchmarks/planner_measured.py` (which does the same for the zoo), all at the same global batch and estimated
by the same cost model (every candidate's estimate is printed; those not named are not run: on this shared
2-core host compiling a layout of 8 one-stage pipelines took 874 s). Each layout is trained by
`cfp.train_pipelines` (the runtime any user model runs on; one compile cache for all) for `--steps` steps per
round, the layouts in turns within each round, so that a busy spell of the shared host falls on all alike; a
round's measured figures are the median wall time of the steps after the first (`TrainResult.step_seconds`) and
the CPU time of all the process's threads per step (a run of 1 + `--steps` steps less a run of 1). As in
`planner_measured.py`: the `cpu` catalog entry describes the host's cores as an idle host gives them, so the
estimate is set beside the measured CPU time over the host's cores (which other users' load does not stretch the
way it stretches wall time), and beside the measured wall time at the cores the host gave a reference GEMM
just before each run (the catalog's estimate times cores / share, one factor for all layouts). Prints per layout
both ratios, the rankings, `planner's pick: estimate/measured ratio R` (wall) and `worst estimate/measured
ratio: R`. With `--zoo NAME:CONFIG:LAYERS` the model is a zoo model as a LayeredModel, priced by its derived
facts and, beside them, by its hand-written `ModelCost`: the same measured runs against both.

    PYTHONPATH=$PWD python benchmarks/planner_user_model.py [--model tests/layered_mixer.py:make_bench] [--rounds 5]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import yaml  # noqa: E402

from cfp.hardware.cpu_calibration import CPU  # noqa: E402
from cfp.planner.cluster import parse_cluster  # noqa: E402
from cfp.planner.costmodel import CostModel  # noqa: E402
from cfp.planner.options import PlannerOptions  # noqa: E402
from planner_measured import _middle_spread, _reference, candidates, host_share, swapped_pairs  # noqa: E402

CLUSTER = os.path.join(ROOT, "examples", "clusters", "local.yaml")
DEFAULT_MODEL = os.path.join(ROOT, "tests", "layered_mixer.py") + ":make_bench"


def measure(user, layouts, rounds: int, steps: int, log) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Per layout and round (the layouts in turns): the measured wall seconds of a step (the median of a run's
    steps after the first) and its CPU seconds (all the process's threads: a run of 1 + `steps` steps less a run
    of 1, over `steps`; other users' load on the host stretches wall time, not CPU time); and per run the cores
    the host gave the reference program just before it."""
    import cfp
    from cfp.runtime.stage.cache import CompileCache
    cache = CompileCache(user.model, user.optimizer)
    quiet = lambda *a, **k: None  # noqa: E731
    for name, lay in layouts:                                    # compile and warm up every layout once
        t0 = time.perf_counter()
        cfp.train_pipelines(user.model, user.optimizer, lay, user.batches, steps=2, cache=cache, log=quiet)
        log(f"  compiled and warmed up {name}: {time.perf_counter() - t0:.1f} s (measured)")
    reference = _reference()
    wall, cpu, share = [[] for _ in layouts], [[] for _ in layouts], []
    run = lambda lay, n: cfp.train_pipelines(user.model, user.optimizer, lay, user.batches, steps=n, cache=cache,
                                             log=quiet)
    for r in range(rounds):
        for i, (name, lay) in enumerate(layouts):
            share.append(host_share(reference))
            c0 = time.process_time()
            run(lay, 1)
            c1 = time.process_time()
            res = run(lay, 1 + steps)
            cpu[i].append(max((time.process_time() - c1) - (c1 - c0), 0.0) / steps)
            losses = list(res.losses.values())
            if not res.step_seconds or not all(math.isfinite(v) for v in losses):
                raise SystemExit(f"{name}: no measured step or a non-finite loss ({losses})")
            wall[i].append(statistics.median(res.step_seconds))
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{w[-1]:.3f}/{c[-1]:.3f}" for w, c in zip(wall, cpu))
            + f" s per step wall/CPU; host share {statistics.median(share[-len(layouts):]):.2f} cores (measured)")
    return wall, cpu, share


def report(layouts, est, wall, cpu, cores_now: float, others=()) -> float:
    """The table, rankings and ratios (module doc); `others`: (label, estimates) of the same layouts by other
    figures (the zoo's ModelCost); returns the planner's pick's estimate/measured ratio."""
    scale = CPU.cores / cores_now
    print(f"host share during the runs: {cores_now:.2f} of {CPU.cores} cores (measured, median); estimates at that "
          f"share are the catalog's (all {CPU.cores} cores) x {scale:.2f}")
    print(f"{'layout':<24} {'est. idle (s)':>13} {'meas. CPU/cores (s)':>19} {'est/meas':>8} {'est. at share (s)':>17} "
          f"{'meas. wall (s)':>14} {'noise':>6} {'est/meas':>8}  shape")
    ratios, med, spread = [], [], []
    for (name, lay), e, w, c in zip(layouts, est, wall, cpu):
        m, mc = statistics.median(w), statistics.median(c) / CPU.cores
        ratios.append(e * scale / m)
        med.append(m)
        spread.append(_middle_spread(w))
        print(f"{name:<24} {e:>13.4f} {mc:>19.4f} {e / mc if mc else float('nan'):>8.2f} {e * scale:>17.4f} "
              f"{m:>14.4f} {(max(w) - min(w)) / 2 / m:>6.1%} {e * scale / m:>8.2f}  {lay.summary()}")
    for label, other in others:
        print(f"  {label}: " + ", ".join(
            f"{name} est. {o:.4f} s idle ({o / (statistics.median(c) / CPU.cores):.2f} of CPU/cores, "
            f"{o * scale / statistics.median(w):.2f} of wall)" for (name, _), o, w, c in zip(layouts, other, wall, cpu)))
    by_est = [layouts[i][0] for i in sorted(range(len(est)), key=est.__getitem__)]
    by_meas = [layouts[i][0] for i in sorted(range(len(med)), key=med.__getitem__)]
    print(f"ranking by estimate: {' < '.join(by_est)}")
    print(f"ranking by measured: {' < '.join(by_meas)}")
    swaps = swapped_pairs(est, med, spread)
    real = sum(beyond for *_, beyond in swaps)
    print(f"rank order estimated vs measured: {'same' if by_est == by_meas else 'different'}"
          + (f" ({len(swaps)} pair(s) swapped, {real} by more than the measured spread)" if swaps else ""))
    worst = max(ratios, key=lambda r: max(r, 1 / r))
    print(f"planner's pick: estimate/measured ratio {ratios[0]:.2f}")
    print(f"worst estimate/measured ratio: {worst:.2f}")
    return ratios[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a factory, module.path:factory or file.py:factory")
    ap.add_argument("--zoo", default=None, metavar="NAME:CONFIG:LAYERS",
                    help="instead, a zoo model as a LayeredModel (e.g. llama2:small:8) with AdamW, estimated by its "
                         "derived facts and, beside them, by its hand-written ModelCost")
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--example-rows", type=int, default=2, help="rows of the micro-batch the facts are derived on")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first of each run is not timed)")
    ap.add_argument("--layouts", default="planner,2 pipelines x 4 stages,1 pipeline x 8 stages",
                    help="comma-separated names of the candidate layouts to run (the planner's pick first)")
    args = ap.parse_args()
    from cfp.cli.factory import load_factory
    from cfp.planner.model_facts import facts_for
    with open(CLUSTER) as f:
        cluster = parse_cluster(yaml.safe_load(f))
    user, zoo_config = (_zoo(args.zoo) if args.zoo else (load_factory(args.model), None))
    t0 = time.perf_counter()
    facts = facts_for(user.model, cluster, user.batches(0, args.example_rows), user.optimizer)
    derive = time.perf_counter() - t0
    options = PlannerOptions(global_batch_size=args.global_batch_size)
    cm = CostModel(facts, cluster, options.schedule)
    every = candidates(cm, options)
    for name, lay in every:
        print(f"candidate {name:<24} estimated {cm.estimate(lay).step_time:.4f} s (idle host)  {lay.summary()}")
    wanted = [w.strip() for w in args.layouts.split(",") if w.strip()]
    layouts = [(n, lay) for n, lay in every if n in wanted]
    if not layouts or layouts[0][0] != "planner":
        raise SystemExit(f"--layouts {args.layouts!r} must name the planner's pick first and known candidates: "
                         f"{', '.join(n for n, _ in every)}")
    est = [cm.estimate(lay).step_time for _, lay in layouts]
    others = []
    if zoo_config is not None:
        zoo_cm = CostModel(zoo_config, cluster, options.schedule)
        others.append(("ModelCost (hand-written) estimates", [zoo_cm.estimate(lay).step_time for _, lay in layouts]))
    print(f"{args.zoo or args.model}: {facts.num_layers} layers, {facts.dtype} dots, cost facts derived on {facts.backend} in "
          f"{derive:.1f} s (measured); global batch {args.global_batch_size}, schedule {options.schedule.value}, on "
          f"{cluster.summary()}; host load average {os.getloadavg()[0]:.1f} on {CPU.cores} cores", flush=True)
    wall, cpu, share = measure(user, layouts, args.rounds, args.steps, lambda s: print(s, flush=True))
    report(layouts, est, wall, cpu, statistics.median(share), others)


def _zoo(spec: str):
    """(`UserModel` of a zoo model as a LayeredModel with AdamW, its config) from NAME:CONFIG:LAYERS."""
    import jax
    import numpy as np
    import optax

    from cfp.cli.factory import UserModel
    from cfp.models import get_config, make_batch
    from cfp.models.layered import zoo_model
    name, config, layers = spec.split(":")
    cfg = get_config(name, config, num_layers=int(layers))
    batches = lambda step, rows: jax.tree_util.tree_map(  # noqa: E731
        np.asarray, make_batch(name, cfg, rows, jax.random.PRNGKey(step)))
    return UserModel(zoo_model(name, cfg), batches, optax.adamw(1e-3), spec), cfg


if __name__ == "__main__":
    main()
