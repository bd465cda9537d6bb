"""Regenerate the golden plans in tests/golden/plans/ (one per model and mesh) through the public API.

    .venv/bin/python benchmarks/regen_golden_plans.py            # rewrite all
    .venv/bin/python benchmarks/regen_golden_plans.py --check    # compare only; exit 1 on a difference
    .venv/bin/python benchmarks/regen_golden_plans.py --check --only gpt_8    # some cases

Each golden file is the `Plan` that `cfp.autoshard(..., profiler="estimate", verify=0)` returns, saved with
`Plan.save` exactly as `cfp search --plan-out` saves one (per-block estimates, profile points, and the model's
name, config and batch size so `cfp explain --gpu` can re-estimate it): `cfp.load_plan`, `cfp.apply_plan`,
`cfp explain` and `cfp diff` all read them. The plans come from the cost-model profiler (A100-SXM-80G) without
whole-step timing, so they are deterministic for a given JAX version: a changed golden file means the analysis,
the profiler's pruning or the search changed its mind, which a reviewer should see in the diff.
`tests/test_golden_plans.py` checks each against an exhaustive reference over the same profile table.
"""
import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import cfp  # noqa: E402
from cfp.models import get_config, train_step  # noqa: E402
from cfp.report.estimates import model_metrics  # noqa: E402

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "tests" / "golden" / "plans"
# (model, mesh, variant); a variant overrides config fields. "wide_vocab" (a 32768-token vocabulary) makes the
# head's gradient all-reduce dominate, so its optimum is NOT uniform data parallel (strategy 0 everywhere)
CASES = [("gpt", "8", ""), ("gpt", "2x4", ""), ("llama2", "8", ""), ("moe", "8", ""), ("gpt", "8", "wide_vocab")]
VARIANTS = {"": {}, "wide_vocab": {"vocab_size": 32768}}
SETTINGS = dict(config="tiny", num_layers=1, batch_size=8, gpu="A100-SXM-80G", max_combinations=4)


def golden_args(model: str, variant: str = ""):
    """(train step, (params, opt_state, batch)) of a golden case; zero parameters: the estimate profiler
    needs shapes only."""
    s = SETTINGS
    ts = train_step(model, get_config(model, s["config"], num_layers=s["num_layers"], **VARIANTS[variant]))
    params, opt = jax.eval_shape(ts.init, jax.random.PRNGKey(0))
    params, opt = jax.tree_util.tree_map(lambda a: jax.numpy.zeros(a.shape, a.dtype), (params, opt))
    return ts, (params, opt, ts.make_batch(s["batch_size"], jax.random.PRNGKey(1)))


def golden_plan(model: str, mesh: str, variant: str = "") -> cfp.Plan:
    """The plan cfp chooses for `model` on `mesh` under the golden settings, as the `Plan` to save."""
    s = SETTINGS
    ts, args = golden_args(model, variant)
    step = cfp.autoshard(ts.step, mesh, *args, profiler="estimate", gpu=s["gpu"],
                         max_combinations=s["max_combinations"], verify=0)
    metrics = {**step.plan.metrics, "mesh": mesh, "config": s["config"],
               "golden_settings": dict(s, **VARIANTS[variant]), **model_metrics(model, ts.config, s["batch_size"])}
    return dataclasses.replace(step.plan, metrics=metrics)


def path_for(model: str, mesh: str, variant: str = "") -> Path:
    return GOLDEN_DIR / f"{model}_{mesh}{'_' + variant if variant else ''}.json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the files instead of rewriting them")
    names = [path_for(*c).stem for c in CASES]
    p.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"only these cases: {', '.join(names)}")
    args = p.parse_args()
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    status = 0
    for model, mesh, variant in CASES:
        if args.only and path_for(model, mesh, variant).stem not in args.only:
            continue
        plan = golden_plan(model, mesh, variant)
        path = path_for(model, mesh, variant)
        if args.check:
            old = cfp.load_plan(str(path)) if path.exists() else None
            same = old is not None and (old.choice, old.shard_state) == (plan.choice, plan.shard_state)
            print(f"{path.name}: {'same' if same else 'DIFFERENT'}")
            status |= 0 if same else 1
        else:
            plan.save(str(path))
            print(f"wrote {path.name}: {list(plan.choice)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
