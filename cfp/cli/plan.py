"""`cfp plan`: from a cluster file of mixed devices to a layout `cfp train --layout` runs (HexiScale).

Example::

    cfp plan --cluster examples/clusters/paper-7b-13b-a.yaml --model llama2 --config 7B --compare
    cfp plan --cluster examples/clusters/local.yaml --model my_model.py:make --global-batch-size 16 --out l.json

A zoo model is priced by its hand-written `cfp.costs.ModelCost`; a factory's model (``module.path:factory`` or
``file.py:factory``, see `cfp.cli.factory`) by the cost facts derived from its own traced and compiled parts.
"""
from __future__ import annotations

import argparse
import sys
import time

from cfp.cli import common
from cfp.cli.factory import is_factory
from cfp.errors import ConfigError, InfeasibleError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="plan a heterogeneous 3D-parallel layout for a cluster",
                              description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster file (YAML)")
    p.add_argument("--model", required=True,
                   help=f"zoo model ({', '.join(ZOO)}) or a factory, module.path:factory or file.py:factory")
    p.add_argument("--config", default=None,
                   help=f"named config of a zoo model (default: {common.DEFAULT_CONFIG})")
    common.add_shape_overrides(p, dtype_help="compute dtype (the paper comparisons use bfloat16)")
    p.add_argument("--example-rows", type=common.positive_int, default=2,
                   help="a factory's model: rows of the example micro-batch its cost facts are derived on")
    p.add_argument("--tokens-per-row", type=common.positive_int, default=1,
                   help="a factory's model: tokens per batch row, for the tokens/s estimate (1: rows/s)")
    p.add_argument("--global-batch-size", type=common.positive_int, default=None,
                   help="sequences (a factory's model: batch rows) per step (default: 4 per device)")
    common.add_plan_schedule(p)
    common.add_recompute(p, "per stage the least recomputation whose kept activations fit its memory under its "
                            "schedule; the choice is written to the layout file")
    p.add_argument("--out", default=None, metavar="FILE", help="write the layout file (JSON) here")
    p.add_argument("--stage-times", default=None, metavar="DIR",
                   help="stage plans saved by `cfp train --stage-plans search` (CHECKPOINT_DIR/stage_plans): "
                        "stages of the same shape on the same device are priced by their measured times")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure this host's devices again (the `cpu` entry; otherwise measured once per host and "
                        "cached, CFP_CACHE_DIR; CFP_CALIBRATE=0 uses the catalog's)")
    p.add_argument("--compare", action="store_true",
                   help="also estimate a Megatron-style layout, a greedy heuristic and, up to 16 devices, "
                        "the exhaustive optimum")
    p.set_defaults(func=run)
    return p


ZOO = ("gpt", "llama2", "moe", "bert")


def load_cluster_file(path: str):
    from cfp.planner.cluster import Cluster
    return Cluster.load(path)


def host_devices(cluster, recalibrate: bool = False):
    """(cluster, which figures price it): its `cpu` machines described by this host's measured entry
    (`cfp.hardware.host_entry`: measured on first use, said so on stderr, then cached), else the catalog's."""
    if not cluster.has_device("cpu"):
        if recalibrate:
            raise ConfigError("--recalibrate measures this host's devices (the cpu entry); the cluster has none")
        return cluster, "catalog entries (published datasheets, cfp/hardware/gpus.py)"
    from cfp.hardware.host_entry import host_figures
    figures = host_figures(recalibrate, log=lambda line: print(line, file=sys.stderr, flush=True))
    return cluster.with_device(figures.spec), f"cpu devices: {figures.describe()}" + (
        "; the other devices: catalog entries (published datasheets)" if len(
            {m.gpu.name for m in cluster.machines}) > 1 else "")


def load_stage_times(directory: str, model: str, config):
    """`MeasuredStageTimes` from the stage plans a `cfp train --stage-plans search` run saved in `directory`:
    the per-micro-batch time of every multi-device stage measured there (the sharding that runs: searched or
    Megatron), for `model`'s `config` only."""
    from cfp.planner.measured import StageShape, measured_stage_times
    from cfp.runtime.stage.plans import StagePlans
    plans = StagePlans.load(directory)
    if plans.model != model or not plans.config:
        raise ConfigError(f"--stage-times {directory!r}: stage plans of model {plans.model!r}"
                          + ("" if plans.config else " without a model config (saved by an older cfp)")
                          + f", planning {model!r}")
    depth = [p.num_stages for p in plans.layout.pipelines]
    stages = [(StageShape(p.tp, p.layers[1] - p.layers[0], p.stage == 0, p.stage == depth[p.pipeline] - 1,
                          p.micro_batch_size), p.measured_time())
              for p in plans.plans if p.measured_time() is not None]
    return measured_stage_times(plans.device, plans.config, stages, source=directory).check_config(config)


def _table(cm, layout, est) -> str:
    cl = cm.cluster
    head = ("pipeline", "stage", "GPUs", "TP", "layers", "micro-batches", "recompute", "memory (est.)",
            "time/mb (est. unless marked)")
    rows = []
    for p, (pipe, ests) in enumerate(zip(layout.pipelines, est.stages)):
        for s, (st, e) in enumerate(zip(pipe.stages, ests)):
            ids = st.devices
            contiguous = len(ids) > 1 and list(ids) == list(range(ids[0], ids[-1] + 1))
            span = f"{ids[0]}-{ids[-1]}" if contiguous else ",".join(map(str, ids))
            rows.append((str(p), str(s), f"{cl.machines[st.machine].gpu.name} [{span}]", str(st.tp),
                         str(st.layers), f"{pipe.chunks} x {pipe.micro_batch}", e.recompute.value,
                         f"{e.memory / 1e9:.2f}/{e.capacity / 1e9:.0f} GB",
                         f"{(e.fwd + e.bwd) * 1e3:.1f} ms" + (" (measured)" if e.measured else "")))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows])


def _schedule_lines(reports) -> list[str]:
    """Per pipeline: its schedule, its simulated and formula time, the other candidates and why
    (`cfp.planner.schedule_choice`)."""
    out = ["schedule per pipeline (formula: the schedule's time formula with the cost model's stage times; "
           "simulated: its table generated from those times, replayed with every stage owning its compute):"]
    for r in reports:
        out.append("  " + r.line())
        c = r.chosen
        if c.peak:
            worst = max(range(len(c.peak)), key=lambda i: c.peak[i] / c.limit[i])
            out.append(f"    kept activations (est.) at most {c.peak[worst] / 1e9:.2f} of the {c.limit[worst] / 1e9:.2f}"
                       f" GB stage {worst} has for them ({c.spec.entry.placement.value} placement, "
                       f"{'B and W split' if c.spec.entry.split else 'whole backward'})")
    return out


def _compare(cm, options, planned) -> list[str]:
    from cfp.planner.baselines import greedy_layout, megatron_layout
    from cfp.planner.exhaustive import MAX_DEVICES, exhaustive_layout
    lines = ["comparison (estimated, same cost model):",
             f"  {'planner (HexiScale)':<28} step {planned.step_time:9.4f} s  MFU {100 * planned.mfu:6.2f}%"]
    for name, fn in (("Megatron-style (uniform)", megatron_layout), ("greedy speed-proportional", greedy_layout)):
        r = fn(cm, options)
        lines.append(f"  {name:<28} " + ("no layout fits" if r is None else
                                         f"step {r[1].step_time:9.4f} s  MFU {100 * r[1].mfu:6.2f}%"))
    if cm.cluster.num_devices <= MAX_DEVICES:
        try:
            lay, e, n = exhaustive_layout(cm, options)
            lines.append(f"  {'exhaustive optimum':<28} step {e.step_time:9.4f} s  MFU {100 * e.mfu:6.2f}%"
                         f"  ({n} layouts; planner within {100 * (planned.step_time / e.step_time - 1):.2f}%)")
        except InfeasibleError as err:
            lines.append(f"  {'exhaustive optimum':<28} skipped: {err}")
    else:
        lines.append(f"  {'exhaustive optimum':<28} skipped: more than {MAX_DEVICES} devices")
    return lines


def run(args: argparse.Namespace) -> int:
    from cfp.models import get_config
    from cfp.planner.costmodel import CostModel
    from cfp.planner.layout_file import LayoutFile, write_layout_file
    from cfp.planner.options import PlannerOptions
    from cfp.planner.planner import find_layout

    common.check_outputs(args, files_={"out": "--out"})
    cluster, priced_by = host_devices(load_cluster_file(args.cluster), args.recalibrate)
    t0 = time.perf_counter()
    overrides = {k: v for k, v in (("num_layers", args.num_layers), ("seq_len", args.seq_len),
                                   ("dtype", args.dtype)) if v is not None}
    if is_factory(args.model):
        config, what = _factory_facts(args, cluster, overrides)
        stage_times = None
    else:
        if args.model not in ZOO:
            raise ConfigError(f"--model {args.model!r} is not a zoo model ({', '.join(ZOO)}) nor a factory "
                              "(module.path:factory or file.py:factory)")
        args.config = args.config or common.DEFAULT_CONFIG
        config = get_config(args.model, args.config, **overrides)
        stage_times = load_stage_times(args.stage_times, args.model, config) if args.stage_times else None
        what = (f"{args.model} {args.config} ({config.num_layers} layers, seq {config.seq_len}, "
                f"{config.dtype})")
    options = PlannerOptions(global_batch_size=args.global_batch_size or 4 * cluster.num_devices,
                             schedule=args.schedule, stage_times=stage_times, recompute=args.recompute)
    result = _plan_with_progress(cluster, config, options)
    cm = CostModel(config, cluster, options.schedule, stage_times, options.features)
    est = result.estimate
    print(f"cluster: {cluster.summary()} ({cluster.num_devices} devices); model {what}; global batch "
          f"{options.global_batch_size}; schedule {args.schedule}; recompute {args.recompute}")
    print(f"figures: {priced_by}")
    print(_table(cm, result.layout, est))
    from cfp.planner.schedule_choice import schedule_reports
    from cfp.planner.step_features import Among
    reports = schedule_reports(cm, result.layout, est)
    print("\n".join(_schedule_lines(reports)))
    if stage_times is not None:
        n, total = sum(e.measured for ests in est.stages for e in ests), sum(map(len, est.stages))
        print(f"stage times: {n} of {total} stages priced by times measured on {stage_times.device} "
              f"({args.stage_times})" + ("; the others estimated" if n < total else ""))
    compute = est.step_time - est.dp_time - est.update_time
    shared = any(m.gpu.shared_host for m in cluster.machines)
    print(f"estimated step time: {est.step_time:.4f} s (compute {compute:.4f} s: slowest pipeline "
          f"{max(est.pipeline_time):.4f} s" + (", on a shared host its work over its devices" if shared else "")
          + f"; gradient sync {est.dp_time:.4f} s, update {est.update_time:.4f} s)")
    if args.compare:
        print("\n".join(_compare(cm, options, est)))
    if args.out:
        chosen = [r.chosen.spec for r in reports]
        n = len(result.layout.pipelines)     # each stage's policy under the schedule its pipeline was given
        policies = tuple(tuple(e.recompute for e in cm.stage_estimates(pipe, Among(n, p == 0), spec))
                         for p, (pipe, spec) in enumerate(zip(result.layout.pipelines, chosen)))
        lf = LayoutFile(model=args.model, config=args.config or "", overrides=overrides, schedule=chosen[0].name,
                        layout=result.layout, estimate=_estimate_dict(est, chosen), cluster=cluster.to_dict(),
                        schedules=tuple(str(s) for s in chosen), recompute=policies)
        write_layout_file(args.out, lf)
        print(f"layout written to {args.out}")
    print(f"estimated MFU: {100 * est.mfu:.2f}% (against the catalog's dense "
          f"{'/'.join(p.value for p in cm.precisions())} peaks)")
    unit = "rows" if is_factory(args.model) and args.tokens_per_row == 1 else "tokens"
    print(f"estimated {unit}/s: {est.tokens_per_s:.0f}")
    print(f"planning time: {time.perf_counter() - t0:.2f} s (measured)")
    sys.stdout.flush()
    return 0


def _factory_facts(args, cluster, overrides):
    """(cost facts, description) of the model a factory returns, derived on its step-0 example micro-batch."""
    from cfp.cli.factory import load_factory
    from cfp.planner.model_facts import facts_for
    given = {"--config": args.config, "--stage-times": args.stage_times,
             **{"--" + k.replace("_", "-"): v for k, v in overrides.items()}}
    for flag, value in given.items():
        if value is not None:
            raise ConfigError(f"{flag} {value} is for zoo models; --model {args.model!r} is a factory, whose "
                              "model has its own shapes")
    user = load_factory(args.model)
    example = user.batches.example(args.example_rows)
    facts = facts_for(user.model, cluster, example, user.optimizer, args.tokens_per_row)
    return facts, (f"{args.model} ({facts.num_layers} layers, {facts.dtype} dots; cost facts derived on "
                   f"{facts.backend} from a micro-batch of {args.example_rows} rows)")


def _plan_with_progress(cluster, config, options):
    from rich.progress import Progress

    from cfp.planner.planner import find_layout
    with Progress(transient=True, console=_stderr_console()) as bar:
        task = bar.add_task("planning", total=None)
        return find_layout(cluster, config, options,
                           progress=lambda done, total: bar.update(task, completed=done, total=total))


def _stderr_console():
    from rich.console import Console
    return Console(stderr=True)


def _estimate_dict(est, chosen) -> dict:
    return {"step_time_s": est.step_time, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
            "pipeline_time_s": list(est.pipeline_time), "gradient_sync_s": est.dp_time,
            "stage_memory_bytes": [[s.memory for s in row] for row in est.stages],
            "schedules": [str(s) for s in chosen], "estimated": True}
