"""Apply random strategy choices and compare with the unsharded step and with the predicted collectives.

    .venv/bin/python benchmarks/random_plan_check.py [--models gpt,llama2,moe,bert] [--mesh 2x4] [--plans 3]

For each model (tiny config, `--num-layers` layers) the loss-and-gradient function is analysed, `--plans`
random choices (one strategy per ParallelBlock, seeded) are applied, and for each the script prints the
largest error against the unsharded run (relative to the largest loss/gradient value) and every collective XLA inserted that the analysis did not
predict (`check_collectives`). A wider net than the test suite's fixed plans; prints figures, asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cfp.cli.common import ensure_host_devices, positive_int  # noqa: E402
from cfp.models.configs import MODEL_NAMES  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,llama2,moe,bert")
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--num-layers", dest="num_layers", type=positive_int, default=2)
    p.add_argument("--plans", type=positive_int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    models = args.models.split(",")
    bad = [m for m in models if m not in MODEL_NAMES]
    if bad:
        print(f"error: unknown model(s) {bad}; valid: {', '.join(MODEL_NAMES)}", file=sys.stderr)
        return 2
    ensure_host_devices()
    import jax
    import numpy as np

    from cfp.analysis.analysis import analyze_with_program
    from cfp.sharding.step import apply_choice
    from cfp.sharding.check import check_collectives
    from cfp.models import get_config, loss_fn, make_batch, train_step

    agree = total = 0
    for model in models:
        cfg = get_config(model, "tiny", num_layers=args.num_layers)
        params = jax.jit(train_step(model, cfg).init)(jax.random.PRNGKey(0))[0]
        batch = make_batch(model, cfg, 8, jax.random.PRNGKey(1))
        step = jax.value_and_grad(loss_fn(model, cfg))
        analysis, program = analyze_with_program(step, args.mesh, params, batch)
        want = jax.tree_util.tree_leaves(jax.jit(step)(params, batch))
        rng = random.Random(args.seed)
        for k in range(args.plans):
            choice = [rng.randrange(len(b.strategies)) for b in analysis.blocks]
            sharded = apply_choice(program, analysis, choice)
            problems = check_collectives(analysis, sharded.shardings, sharded.collectives(params, batch))
            got = jax.tree_util.tree_leaves(sharded(params, batch))
            # relative to the largest value of loss and gradients: some gradients are exactly zero in math
            # (attention key biases) and float noise there has no scale of its own
            scale = max(float(np.max(np.abs(b))) for b in want)
            err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)) / scale
            total += 1
            agree += not problems
            print(f"{model} plan {k}: max relative error {err:.1e}; unpredicted collectives: {len(problems)}",
                  flush=True)
            for line in problems:
                print(f"    {line}")
    print(f"collectives as predicted in {agree} of {total} plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
