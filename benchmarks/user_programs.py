"""cfp vs the layouts users write on the examples' user programs (Equinox, Flax NNX, scanned Linen), measured
side by side on 8 simulated CPU devices, without a budget and under a budget below plain data parallel's memory.

    python benchmarks/user_programs.py [--budget-fraction 0.85] [--rounds 10] [--verify N]

Per style: cfp searches (measure profiler) on a 2x4 mesh; the layouts are those its search verified beside its
own plans (`cfp.baselines.user_layouts`: plain data parallel, plain FSDP by in/out shardings alone, DP x TP by
the Megatron rules, and the Alpa-style ILP's plan); all fitting plans are then timed in turns (interleaved
rounds), so a burst of load on a shared host lands on all of them alike.
"""
import argparse
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import cfp  # noqa: E402
from cfp.baselines.user_layouts import USER_LAYOUTS, user_layout_shardings  # noqa: E402
from cfp.errors import ConfigError, InfeasibleError  # noqa: E402
from cfp.sharding.step import ShardedStep  # noqa: E402
from cfp.search.options import fmt_bytes  # noqa: E402
from cfp.xla.compiled import compiled_memory  # noqa: E402
from side_by_side import time_side_by_side  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STYLES = ("equinox_gpt", "flax_nnx", "scanned_linen")


def _example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(label, steps, args, rounds, budget):
    fits = {k: s for k, s in steps.items() if s is not None and
            (budget is None or compiled_memory(s.compile(*args)) <= budget)}
    timed = time_side_by_side(fits, args, rounds)
    dp = timed.get("plain data parallel", (None,))[0]
    print(f"  {label}:")
    for k, s in steps.items():
        if s is None:
            print(f"    {k:22s} infeasible under the budget")
            continue
        mem = compiled_memory(s.compile(*args))
        if k not in timed:
            print(f"    {k:22s} does not fit ({fmt_bytes(mem)} per device, compiled)")
            continue
        t, noise = timed[k]
        vs = f", {dp / t:.2f}x plain data parallel" if dp and k != "plain data parallel" else ""
        same = [o for o, p in steps.items() if o != k and o != "cfp" and p is not None
                and k == "cfp" and p.shardings == s.shardings]
        vs += f" (the same plan as {same[0]}: timed twice, the gap is noise)" if same else ""
        print(f"    {k:22s} {t * 1e3:8.3f} ms ±{noise * 100:.0f}% (measured), {fmt_bytes(mem)} per device "
              f"(compiled){vs}")


def bench(name: str, fraction: float, rounds: int, max_combinations: int = 4, verify: int | None = None) -> None:
    mod = _example(name)
    step_fn, args, _ = mod.problem()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    searched = cfp.autoshard(step_fn, mesh, *args, iters=3, max_combinations=max_combinations, verify=verify)
    program, analysis = searched.program, searched.analysis
    layouts = _layouts(searched, args, mesh)
    dp = layouts["plain data parallel"]
    budget = int(fraction * compiled_memory(dp.compile(*args)))
    print(f"{name}: {len(analysis.blocks)} blocks; cfp plan {list(searched.shardings.choice)}"
          + f" ({searched.search.best.label})")
    _row("no budget", {"cfp": searched, **layouts}, args, rounds, None)
    try:
        tight = cfp.autoshard(step_fn, mesh, *args, iters=3, max_combinations=max_combinations,
                              memory_limit=budget, verify=verify)
        print(f"    cfp under the budget chose: {tight.search.best.label}")
    except InfeasibleError as e:
        print(f"    cfp under the budget: {e}")
        tight = None
    _row(f"budget {fmt_bytes(budget)} ({fraction:.0%} of plain data parallel's compiled memory)",
         {"cfp": tight, **layouts}, args, rounds, budget)


def _layouts(searched, args, mesh) -> dict:
    """label -> step of the layouts users write (and the ILP's plan) the search verified beside its own; built
    here when the search verified nothing whole (`--verify 0`)."""
    if searched.search.layouts:
        return {v.label: searched.search.steps[v.key] for v in searched.search.layouts}
    out = {}
    for layout in USER_LAYOUTS:
        try:
            sh = user_layout_shardings(layout, searched.analysis, args)
        except ConfigError:
            continue
        out[layout.label] = ShardedStep(searched.program, searched.analysis, sh, mesh)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-fraction", type=float, default=0.85)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--styles", default=",".join(STYLES), help=f"comma-separated subset of {','.join(STYLES)}")
    p.add_argument("--max-combinations", type=int, default=4, help="profiled combinations per segment")
    p.add_argument("--verify", type=int, default=None,
                   help="whole-step plans each search compiles and times (default: cfp.SearchOptions's)")
    a = p.parse_args()
    styles = [s for s in a.styles.split(",") if s]
    bad = [s for s in styles if s not in STYLES]
    if bad or not 0 < a.budget_fraction or a.rounds < 3 or a.max_combinations < 1 or (a.verify or 0) < 0:
        raise SystemExit(f"user_programs: styles {bad} must be among {STYLES}, --budget-fraction > 0, --rounds >= 3, "
                         "--max-combinations >= 1, --verify >= 0")
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, mesh 2x4")
    for name in styles:
        bench(name, a.budget_fraction, a.rounds, a.max_combinations, a.verify)


if __name__ == "__main__":
    main()
