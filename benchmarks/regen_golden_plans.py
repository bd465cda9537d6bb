"""Regenerate the golden plan files in tests/golden/plans/ (one per model and mesh).

    .venv/bin/python benchmarks/regen_golden_plans.py            # rewrite all
    .venv/bin/python benchmarks/regen_golden_plans.py --check    # compare only; exit 1 on a difference

The plans come from the cost-model profiler (`estimate`, A100-SXM-80G) without whole-step timing, so they are
deterministic for a given JAX version: a changed golden file means the analysis, the profiler's pruning or the
search changed its mind, which a reviewer should see in the diff.
"""
import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from cfp.models import get_config, train_step  # noqa: E402
from cfp.api import autoshard  # noqa: E402

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "tests" / "golden" / "plans"
# (model, mesh, variant); a variant overrides config fields. "wide_vocab" (a 32768-token vocabulary) makes the
# head's gradient all-reduce dominate, so its optimum is NOT uniform data parallel (strategy 0 everywhere)
CASES = [("gpt", "8", ""), ("gpt", "2x4", ""), ("llama2", "8", ""), ("moe", "8", ""), ("gpt", "8", "wide_vocab")]
VARIANTS = {"": {}, "wide_vocab": {"vocab_size": 32768}}
SETTINGS = dict(config="tiny", num_layers=1, batch_size=8, gpu="A100-SXM-80G", max_combinations=4)


def golden_step(model: str, mesh: str, variant: str = ""):
    """(searched ShardedStep, example args) of `model` on `mesh` under the golden settings."""
    s = SETTINGS
    ts = train_step(model, get_config(model, s["config"], num_layers=s["num_layers"], **VARIANTS[variant]))
    params, opt = jax.eval_shape(ts.init, jax.random.PRNGKey(0))
    params, opt = jax.tree_util.tree_map(lambda a: jax.numpy.zeros(a.shape, a.dtype), (params, opt))
    batch = ts.make_batch(s["batch_size"], jax.random.PRNGKey(1))
    step = autoshard(ts.step, mesh, params, opt, batch, profiler="estimate", gpu=s["gpu"],
                     max_combinations=s["max_combinations"], verify=0)
    return step, (params, opt, batch)


def golden_plan(model: str, mesh: str, variant: str = "", step=None) -> dict:
    """The plan cfp chooses for `model` on `mesh` under the golden settings, as a JSON-able dict."""
    step = step if step is not None else golden_step(model, mesh, variant)[0]
    a = step.analysis
    return {"model": model, "mesh": mesh, "settings": dict(SETTINGS, **VARIANTS[variant]),
            "choice": list(step.shardings.choice),
            "strategies": [a.notation(b, c) for b, c in enumerate(step.shardings.choice)]}


def path_for(model: str, mesh: str, variant: str = "") -> Path:
    return GOLDEN_DIR / f"{model}_{mesh}{'_' + variant if variant else ''}.json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the files instead of rewriting them")
    args = p.parse_args()
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    status = 0
    for model, mesh, variant in CASES:
        plan = golden_plan(model, mesh, variant)
        path = path_for(model, mesh, variant)
        if args.check:
            same = path.exists() and json.loads(path.read_text())["choice"] == plan["choice"]
            print(f"{path.name}: {'same' if same else 'DIFFERENT'}")
            status |= 0 if same else 1
        else:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(plan, indent=1) + "\n")
            tmp.replace(path)
            print(f"wrote {path.name}: {plan['choice']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
