"""Benchmark: wall time of the analysis pass (capture + ParallelBlocks + segments) for 16-layer GPTs.

    .venv/bin/python benchmarks/analysis_time.py [--num-layers 16] [--mesh 2x4] [--configs tiny 1.3B]

Parameters are shape-only stand-ins (`jax.eval_shape`), so large configs cost no memory. Prints one line per
config and the median of --repeats runs.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from cfp.analysis.analysis import analyze  # noqa: E402
from cfp.models import get_config, train_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt")
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--configs", nargs="+", default=["tiny", "1.3B"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    for name in args.configs:
        cfg = get_config(args.model, name, num_layers=args.num_layers)
        ts = train_step(args.model, cfg)
        params, opt = jax.eval_shape(ts.init, jax.random.PRNGKey(0))
        batch = jax.eval_shape(lambda: ts.make_batch(args.batch_size, jax.random.PRNGKey(1)))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            a = analyze(ts.step, args.mesh, params, opt, batch)
            times.append(time.perf_counter() - t0)
        print(f"{args.model} config={name} layers={args.num_layers} mesh={args.mesh} batch={args.batch_size}: "
              f"operators={len(a.graph.operators)} blocks={len(a.blocks)} unique_segments={a.num_unique_segments} "
              f"global analysis time: median {statistics.median(times):.2f} s (runs: "
              f"{', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
