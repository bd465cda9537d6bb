"""cfp demo: analyse a small GPT's train step on 8 simulated CPU devices and train it sharded.

    make demo        (or: .venv/bin/python examples/demo.py)
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from cfp.analysis import report  # noqa: E402
from cfp.analysis.analysis import analyze_with_program  # noqa: E402
from cfp.analysis.apply import apply_plan, check_collectives  # noqa: E402
from cfp.models import get_config, train_step  # noqa: E402
from cfp.search.uniform import dp_tp_choice  # noqa: E402


def main() -> None:
    cfg = get_config("gpt", "tiny", num_layers=2)
    ts = train_step("gpt", cfg)
    params, opt = jax.jit(ts.init)(jax.random.PRNGKey(0))
    batch = ts.make_batch(16, jax.random.PRNGKey(1))
    print(f"== analysis: GPT tiny (hidden {cfg.hidden_size}, {cfg.num_layers} layers), mesh 2x4, "
          f"{jax.device_count()} devices")
    analysis, program = analyze_with_program(ts.step, params, opt, batch, mesh="2x4")
    print(report.parallel_blocks_text(analysis, max_ops_per_block=2).split("Parallel Block 2:")[0].rstrip())
    print("    ...")
    print(report.segments_text(analysis))
    print(report.summary_text(analysis))
    print(f"global analysis time: {analysis.analysis_time:.2f} s")

    # Data parallel on axis 0 and Megatron-style tensor parallelism on axis 1, expressed as one CFP strategy
    # per ParallelBlock (the search verifies this reference plan next to its own best).
    choice = list(dp_tp_choice(analysis))
    print(f"\n== apply strategies {choice}")
    for b in analysis.blocks[:8]:
        print(f"    block {b.index}: {analysis.notation(b.index, choice[b.index])}")
    sharded = apply_plan(program, analysis, choice)
    t0 = time.perf_counter()
    found = sharded.collectives(params, opt, batch)
    print(f"compiled in {time.perf_counter() - t0:.1f} s; collectives inserted by XLA: {len(found)}; "
          f"mismatches with the prediction: {len(check_collectives(analysis, sharded.plan, found))}")

    print("\n== train 3 steps, sharded vs single device")
    single = jax.jit(ts.step)
    p1, o1 = params, opt
    p2, o2 = sharded.shard_args(params, opt, batch)[:2]
    for step in range(3):
        b = ts.make_batch(16, jax.random.PRNGKey(100 + step))
        p1, o1, l1 = single(p1, o1, b)
        t0 = time.perf_counter()
        p2, o2, l2 = sharded(p2, o2, b)
        l2 = float(l2)
        print(f"step {step}: loss sharded {l2:.6f}  single-device {float(l1):.6f}  "
              f"(sharded step {time.perf_counter() - t0:.3f} s)")
        if not np.isclose(l2, float(l1), rtol=1e-4):
            raise SystemExit(f"demo: sharded loss {l2} differs from single-device loss {float(l1)}")


if __name__ == "__main__":
    main()
