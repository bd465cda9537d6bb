"""`cfp analysis`: print the ParallelBlocks and segments of a model's train step; dump them with --dump-dir."""
from __future__ import annotations

import argparse
import time

from cfp.cli.common import add_model_options, build_step, check_output_dir, ensure_host_devices, integer


def add_parser(sub) -> None:
    p = sub.add_parser("analysis", help="show the parallel blocks and segments cfp finds in a model's train step")
    add_model_options(p)
    p.add_argument("--max-ops", type=integer, default=8, help="non-dot operators printed per block (-1: all)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_output_dir(args.dump_dir, "--dump-dir")
    ensure_host_devices()
    from cfp.analysis.analysis import analyze
    from cfp.analysis import report

    step, example_args, mesh = build_step(args, abstract=True)
    t0 = time.perf_counter()
    analysis = analyze(step, mesh, *example_args)
    elapsed = time.perf_counter() - t0
    print(report.parallel_blocks_text(analysis, None if args.max_ops < 0 else args.max_ops))
    print(report.segments_text(analysis))
    print(report.summary_text(analysis))
    if args.dump_dir:
        for path in report.dump(analysis, args.dump_dir):
            print(f"wrote {path}")
    print(f"global analysis time: {elapsed}")
    return 0
