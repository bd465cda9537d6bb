"""`cfp explain PLAN.json` and `cfp diff A.json B.json`: plans people can read (and `--plot FILE.png`)."""
from __future__ import annotations


def add_parser(sub) -> None:
    e = sub.add_parser("explain", help="per block: scope, strategy, estimated compute/comm/memory, runner-up")
    e.add_argument("plan", help="plan file (cfp search --plan-out, autoshard(plan_out=...), a golden plan)")
    e.add_argument("--gpu", default=None, help="catalog GPU of the estimates (default: the plan's)")
    e.add_argument("--plot", default=None, help="also draw the plan to this PNG file")
    e.set_defaults(func=run_explain)
    d = sub.add_parser("diff", help="the blocks two plans give different strategies, and the cost delta")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--gpu", default=None, help="catalog GPU of the estimates (default: each plan's)")
    d.set_defaults(func=run_diff)


def _views(paths, gpu):
    from cfp.cli.common import ensure_host_devices
    ensure_host_devices()           # `--gpu` re-estimates rebuild the analysis on the simulated devices
    from cfp.hardware.gpus import get_gpu
    from cfp.report.explain import load_view
    if gpu is not None:
        get_gpu(gpu)                # a bad name fails before any loading
    return [load_view(p, gpu) for p in paths]


def run_explain(args) -> int:
    from cfp.cli.common import check_output_file
    from cfp.report.explain import explain_text
    check_output_file(args.plot, "--plot")      # before any loading or re-estimating
    (view,) = _views([args.plan], args.gpu)
    print(explain_text(view))
    if args.plot:
        from cfp.report.plot import plot_plan
        print(f"wrote {plot_plan(view, args.plot)}")
    return 0


def run_diff(args) -> int:
    from cfp.report.explain import diff_text
    a, b = _views([args.a, args.b], args.gpu)
    print(diff_text(a, b))
    return 0
