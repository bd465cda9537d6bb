"""cfp demo: autoshard a small GPT's AdamW train step on 8 simulated CPU devices under a memory budget.

    make demo        (or: .venv/bin/python examples/demo.py [--layers 2] [--mesh 2x4] [--budget-fraction 0.85])

Data parallel does not fit the budget (85% of its own per-device memory), so the search must trade: it
profiles each unique segment under its strategy combinations, runs the DP over segments with the budget,
verifies the best plans whole, and returns the sharded step. The demo prints the plan, trains a few steps
against the single-device step, and times the plan next to data parallel, FSDP, Megatron TP and DP x TP; a
baseline with the plan's own sharding is named as such, never given a ratio.
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import cfp  # noqa: E402
from cfp.mesh import MeshSpec  # noqa: E402
from cfp.models import get_config, train_step  # noqa: E402
from cfp.xla.compiled import compiled_memory  # noqa: E402
from cfp.baselines.handwritten import Baseline, baseline_step  # noqa: E402
from cfp.errors import ConfigError  # noqa: E402
from cfp.sharding.same import same_sharding  # noqa: E402
from cfp.xla.log import quiet_compiles  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--budget-fraction", type=float, default=0.85,
                   help="memory budget as a fraction of data parallel's per-device memory")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if not 0 < args.budget_fraction:
        raise SystemExit(f"demo: --budget-fraction {args.budget_fraction} must be positive")

    cfg = get_config("gpt", "tiny", num_layers=args.layers)
    ts = train_step("gpt", cfg)
    params, opt = jax.jit(ts.init)(jax.random.PRNGKey(0))
    batch = ts.make_batch(16, jax.random.PRNGKey(1))
    spec = MeshSpec.parse(args.mesh, num_devices=jax.device_count())
    mesh = spec.make()
    print(f"== GPT tiny (hidden {cfg.hidden_size}, {cfg.num_layers} layers, batch 16), mesh {spec}, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices")

    dp_fn, dp_shardings = baseline_step(Baseline.DATA_PARALLEL, ts.step, (params, opt, batch), mesh)
    dp_mem = compiled_memory(dp_fn.lower(*jax.device_put((params, opt, batch), dp_shardings)).compile())
    budget = int(dp_mem * args.budget_fraction)
    print(f"data parallel needs {dp_mem / 1e6:.2f} MB per device; budget {budget / 1e6:.2f} MB")

    print("\n== cfp.autoshard (analysis, profiling, search)")
    t0 = time.perf_counter()
    step = cfp.autoshard(ts.step, mesh, params, opt, batch, memory_limit=budget, iters=3, max_combinations=8)
    res = step.search
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    print(res.report())
    names = step.plan.strategies
    for b in range(min(8, len(names))):
        print(f"    block {b}: {names[b]}")
    print(f"    ... {len(names)} blocks")

    print(f"\n== train {args.steps} steps: cfp plan vs single device")
    single = jax.jit(ts.step)
    p1, o1 = params, opt
    p2, o2 = step.shard_args(params, opt, batch)[:2]
    for i in range(args.steps):
        b = ts.make_batch(16, jax.random.PRNGKey(100 + i))
        p1, o1, l1 = single(p1, o1, b)
        p2, o2, l2 = step(p2, o2, b)
        print(f"step {i}: loss cfp {float(l2):.6f}  single-device {float(l1):.6f}")
        if not np.isclose(float(l2), float(l1), rtol=1e-4):
            raise SystemExit(f"demo: sharded loss {float(l2)} differs from single-device loss {float(l1)}")

    print("\n== step time, side by side (measured: median of 10 interleaved runs; memory from the compiled step)")
    runs = {**_baselines(ts.step, (params, opt, batch), mesh),
            "cfp plan": (step.compile(params, opt, batch), jax.tree_util.tree_leaves(step.shard_args(params, opt, batch)))}
    times = _time_side_by_side(runs)
    same = [k for k in runs if k != "cfp plan" and same_sharding(runs[k][0], runs["cfp plan"][0])]
    for k, (c, _) in runs.items():
        mem = compiled_memory(c)
        fits = "fits" if mem <= budget else "over the budget"
        print(f"{k:<14} {statistics.median(times[k]) * 1e3:7.2f} ms (range {min(times[k]) * 1e3:.1f}-"
              f"{max(times[k]) * 1e3:.1f})   {mem / 1e6:6.2f} MB per device ({fits})")
    if same:
        print(f"cfp plan is the {' and '.join(same)} sharding (same per-array input and output shardings): "
              f"same sharding, no ratio")
    fitting = [k for k in runs if k != "cfp plan" and k not in same and compiled_memory(runs[k][0]) <= budget]
    if fitting:
        best = min(fitting, key=lambda k: statistics.median(times[k]))
        ratio = statistics.median(times[best]) / statistics.median(times["cfp plan"])
        print(f"cfp plan vs the best other baseline within the budget ({best}): {ratio:.2f}x "
              f"(measured; >1: cfp faster)")
    else:
        others = [k for k in runs if k != "cfp plan" and k not in same]
        best = min(others, key=lambda k: statistics.median(times[k]))
        ratio = statistics.median(times[best]) / statistics.median(times["cfp plan"])
        print(f"cfp plan vs the fastest baseline with another sharding ({best}, over the budget): {ratio:.2f}x "
              f"(measured; >1: cfp faster); none with another sharding fits the budget")
    remats = step.rematerializations(params, opt, batch)
    print(f"cfp plan: XLA replicated {len(remats)} tensors to reshard them compiling it (involuntary full remats)")


def _baselines(step_fn, args, mesh) -> dict:
    """name -> (compiled step, its placed arguments) of the hand-written baselines that apply on `mesh`; XLA's
    log of their compiles is kept in a file (one summary line)."""
    out = {}
    with quiet_compiles("baseline compiles"):
        for b in (Baseline.DATA_PARALLEL, Baseline.FSDP, Baseline.MEGATRON_TP, Baseline.DP_TP):
            try:
                fn, shardings = baseline_step(b, step_fn, args, mesh)
            except ConfigError as e:
                print(f"{b.value}: not applicable here ({e})")
                continue
            placed = jax.device_put(args, shardings)
            out[b.value] = (fn.lower(*placed).compile(), placed)
    return out


def _time_side_by_side(runs: dict) -> dict:
    """Seconds of 10 interleaved runs of each compiled step (after one warm-up each)."""
    times = {k: [] for k in runs}
    for c, a in runs.values():
        jax.block_until_ready(c(*a))
    for _ in range(10):
        for k, (c, a) in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(c(*a))
            times[k].append(time.perf_counter() - t)
    return times

if __name__ == "__main__":
    main()
