"""Compare CFP's plan with hand-written baselines and an Alpa-style ILP on one train step, side by side.

    python benchmarks/compare.py --model gpt [--config tiny] [--num-layers 2] [--batch-size 16] [--mesh 8|2x4]
                                 [--memory-per-device 4MB] [--iters 20] [--gpu A100-SXM-80G]
                                 [--profile-iters 5] [--max-combinations 12] [--verify 2] [--rows cfp,fsdp]

Rows: data-parallel, fsdp, megatron-tp, dp-tp (2-D mesh only), alpa-ilp, cfp. Columns: median step time, ratio
to the cfp row, per-device memory of the compiled step (arguments + outputs + temporaries, from
`memory_analysis()`), communication bytes per step (per device, summed over the collectives parsed from the
compiled HLO) and planning time. Every row is compiled first, then the rows are timed round-robin (one warm-up
each, then `--iters` rounds) so they see the same machine state; the speedup line gives the larger
run-to-run spread (half the interquartile range over the median) of the two rows it compares. A row over the memory budget is shown as
"OOM (needs X)" and is not timed; a layout that does not apply shows its ConfigError.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cfp.cli.common import build_step, ensure_host_devices, positive_int  # noqa: E402
from cfp.models.configs import MODEL_NAMES  # noqa: E402


def parse_overrides(text: str) -> dict:
    """"vocab_size=16384,capacity_factor=1.5" -> {"vocab_size": 16384, "capacity_factor": 1.5}."""
    from cfp.errors import ConfigError
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not FIELD=VALUE")
        for cast in (int, float):
            try:
                out[key.strip()] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = value.strip()
    return out


def _fmt_bytes(n: float) -> str:
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= s:
            return f"{n / s:.2f} {unit}"
    return f"{n:.0f} B"


class Row:
    def __init__(self, name: str):
        self.name, self.note = name, ""
        self.run = None          # zero-argument callable running one step (blocking)
        self.memory = self.comm = self.plan_time = None
        self.compiled = None     # the compiled step (to tell rows that run the same sharding)
        self.times: list[float] = []

    @property
    def time(self):
        return statistics.median(self.times) if self.times else None

    @property
    def spread(self):
        """Half the interquartile range relative to the median: this row's run-to-run noise."""
        if len(self.times) < 4:
            return None
        q = statistics.quantiles(self.times, n=4)
        return (q[2] - q[0]) / 2 / self.time


def _measure_compiled(row: Row, compiled, call_args, mesh_shape) -> None:
    import jax

    from cfp.xla.hlo import parse_collectives
    from cfp.xla.compiled import compiled_memory
    row.compiled = compiled
    row.memory = compiled_memory(compiled)
    row.comm = sum(c.bytes for c in parse_collectives(compiled.as_text(), mesh_shape))
    row.run = lambda: jax.block_until_ready(compiled(*call_args))


def _baseline_rows(args, step, example_args, spec, mesh, wanted):
    import jax

    from cfp.errors import CfpError
    from cfp.baselines.handwritten import Baseline, baseline_step
    rows = []
    for b in Baseline:
        if (b is Baseline.DP_TP and spec.ndim != 2) or (wanted and b.value not in wanted):
            continue
        row = Row(b.value)
        rows.append(row)
        t0 = time.perf_counter()
        try:
            fn, shardings = baseline_step(b, step, example_args, mesh, args.model)
            placed = jax.device_put(example_args, shardings)
            row.plan_time = time.perf_counter() - t0
            _measure_compiled(row, fn.lower(*placed).compile(), placed, spec.shape)
        except CfpError as e:
            row.note = f"n/a: {e}"
    return rows


def _ilp_row(args, step, example_args, spec, mesh, budget, log) -> Row:
    import jax

    from cfp.analysis.analysis import analyze_with_program
    from cfp.errors import CfpError
    from cfp.baselines.ilp import AlphaBeta, ilp_choice, ilp_step
    row = Row("alpa-ilp")
    try:
        t0 = time.perf_counter()
        analysis, program = analyze_with_program(step, spec, *example_args)
        cm = AlphaBeta()
        if args.gpu:
            from cfp.hardware.gpus import get_gpu
            cm = AlphaBeta.for_gpu(get_gpu(args.gpu))
        res = ilp_choice(analysis, memory_budget=budget, cost=cm, time_limit=args.ilp_time_limit)
        row.plan_time = time.perf_counter() - t0
        row.note = (f"{res.num_variables} vars, {'optimal' if res.optimal else 'time limit'}, "
                    f"{res.disagreements} bwd dots re-indexed")
        log(f"compiling alpa-ilp (choice {list(res.choice)}) ...")
        sharded = ilp_step(program, analysis, res, mesh)
        flat = jax.tree_util.tree_leaves(sharded.shard_args(*example_args))
        _measure_compiled(row, sharded.compile(*example_args), flat, spec.shape)
    except CfpError as e:
        row.note = f"n/a: {e}"
    return row


def _cfp_row(args, step, example_args, spec, mesh, budget, log) -> Row:
    import jax

    from cfp.errors import CfpError
    try:
        from cfp.api import autoshard
    except ImportError as e:
        return Row(f"cfp (search pass not available: {e})")
    row = Row("cfp")
    try:
        t0 = time.perf_counter()
        log(f"planning cfp (profiler {args.profiler}) ...")
        sharded = autoshard(step, mesh, *example_args, memory_limit=budget, profiler=args.profiler,
                            gpu=args.gpu, iters=args.profile_iters, max_combinations=args.max_combinations,
                            verify=args.verify)
        row.plan_time = time.perf_counter() - t0
        row.note = f"choice {list(sharded.shardings.choice)}"
        flat = jax.tree_util.tree_leaves(sharded.shard_args(*example_args))
        _measure_compiled(row, sharded.compile(*example_args), flat, spec.shape)
    except CfpError as e:
        row.note = f"n/a: {e}"
    return row


def build_rows(args, step, example_args, spec, budget, log, wanted=None) -> list[Row]:
    """Compile every requested row (`wanted`: a set of row names, None for all)."""
    mesh = spec.make()
    log("compiling baselines ...")
    rows = _baseline_rows(args, step, example_args, spec, mesh, wanted)
    if not wanted or "alpa-ilp" in wanted:
        rows.append(_ilp_row(args, step, example_args, spec, mesh, budget, log))
    if not wanted or "cfp" in wanted:
        rows.append(_cfp_row(args, step, example_args, spec, mesh, budget, log))
    return rows


def time_rows(rows, iters: int, budget) -> None:
    live = [r for r in rows if r.run is not None and (budget is None or r.memory <= budget)]
    for r in live:
        r.run()                                   # warm-up
    for _ in range(iters):
        for r in live:
            t0 = time.perf_counter()
            r.run()
            r.times.append(time.perf_counter() - t0)


def _same_as(cfp, rows) -> list:
    """The rows whose compiled step places every array as cfp's does (a ratio of them would be noise)."""
    from cfp.sharding.same import same_sharding
    if cfp is None or cfp.compiled is None:
        return []
    return [r for r in rows if r is not cfp and r.compiled is not None and same_sharding(r.compiled, cfp.compiled)]


def render(rows, budget) -> str:
    cfp = next((r for r in rows if r.name.startswith("cfp")), None)
    ref = cfp.time if cfp is not None else None
    head = f"{'plan':<14} {'step time':>11} {'vs cfp':>7} {'memory/dev':>18} {'comm/step':>11} {'planning':>9}  note"
    lines = ["all figures measured on this host: step time = median wall time; memory and comm from the compiled "
             "step (memory_analysis, parsed collectives)", head, "-" * len(head)]
    same = _same_as(cfp, rows)
    for r in rows:
        over = budget is not None and r.memory is not None and r.memory > budget
        t = f"{r.time * 1e3:8.2f} ms" if r.time is not None else "-"
        ratio = "same" if r in same else (f"{r.time / ref:6.2f}x" if r.time is not None and ref else "-")
        mem = f"OOM (needs {_fmt_bytes(r.memory)})" if over else (_fmt_bytes(r.memory) if r.memory is not None else "-")
        comm = _fmt_bytes(r.comm) if r.comm is not None else "-"
        pt = f"{r.plan_time:7.2f} s" if r.plan_time is not None else "-"
        lines.append(f"{r.name[:14]:<14} {t:>11} {ratio:>7} {mem:>18} {comm:>11} {pt:>9}  {r.note}")
    if cfp is not None and cfp.name != "cfp":
        lines.append(cfp.name)   # the fallback label, in full
    base = [r for r in rows if r is not cfp and r.name != "alpa-ilp" and r.time is not None and r not in same]
    alpa = next((r for r in rows if r.name == "alpa-ilp"), None)
    if same:
        lines.append(f"cfp's plan is the {' and '.join(r.name for r in same)} sharding (same per-array input and "
                     f"output shardings): 'same' instead of a ratio, left out of the speedups")
    if ref:
        if base:
            best = min(base, key=lambda r: r.time)
            noise = [x for x in (best.spread, cfp.spread) if x is not None]
            lines.append(f"cfp speedup vs best baseline: {best.time / ref:.2f} ({best.name}"
                         + (f"; run-to-run spread +-{100 * max(noise):.0f}%)" if noise else ")"))
        else:
            lines.append("cfp speedup vs best baseline: n/a (no baseline fits)")
        lines.append("cfp speedup vs alpa-ilp: same sharding" if alpa in same else
                     f"cfp speedup vs alpa-ilp: {alpa.time / ref:.2f}" if alpa is not None and alpa.time
                     else "cfp speedup vs alpa-ilp: n/a (alpa-ilp has no feasible plan)")
    elif cfp is None:
        lines.append("cfp speedup: n/a (cfp row not run, see --rows)")
    else:
        lines.append("cfp speedup: n/a (cfp produced no plan)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=MODEL_NAMES)
    p.add_argument("--config", default="tiny")
    p.add_argument("--num-layers", dest="num_layers", type=positive_int, default=2)
    p.add_argument("--batch-size", dest="batch_size", type=positive_int, default=16)
    p.add_argument("--mesh", default="8", help="8 (1-D) or 2x4 (2-D)")
    p.add_argument("--memory-per-device", default=None, help="per-device budget, e.g. 4MB or 2GB")
    p.add_argument("--iters", type=positive_int, default=20, help="timed rounds (every row once per round)")
    p.add_argument("--profile-iters", dest="profile_iters", type=positive_int, default=None,
                   help="cfp's timed runs per profiled combination and verified plan (default: cfp.SearchOptions')")
    p.add_argument("--max-combinations", type=positive_int, default=None,
                   help="cfp's profiled combinations per segment kind (default: cfp.SearchOptions')")
    p.add_argument("--verify", type=int, default=None,
                   help="cfp's best DP plans compiled and timed whole (default: cfp.SearchOptions')")
    p.add_argument("--gpu", default=None, help="catalog GPU: ILP cost model rates, and cfp's estimate profiler")
    p.add_argument("--profiler", choices=("measure", "estimate"), default="measure")
    p.add_argument("--ilp-time-limit", type=float, default=60.0)
    p.add_argument("--rows", default=None,
                   help="comma-separated subset of rows to run (data-parallel,fsdp,megatron-tp,dp-tp,alpa-ilp,cfp)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--override", default="", help="config field overrides, e.g. vocab_size=16384,seq_len=512")
    args = p.parse_args(argv)
    ensure_host_devices()
    import jax

    from cfp.errors import CfpError
    from cfp.search.options import parse_bytes
    log = (lambda *_: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        budget = parse_bytes(args.memory_per_device) if args.memory_per_device else None
        args.overrides = parse_overrides(args.override)
        step, example_args, spec = build_step(args)
    except CfpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wanted = set(args.rows.split(",")) if args.rows else None
    rows = build_rows(args, step, example_args, spec, budget, log, wanted)
    log(f"timing {args.iters} rounds ...")
    time_rows(rows, args.iters, budget)
    print(f"model {args.model}/{args.config} {args.override or ''} layers={args.num_layers} batch={args.batch_size} mesh={spec} "
          f"({jax.devices()[0].platform} x{jax.device_count()}) budget="
          f"{_fmt_bytes(budget) if budget else 'none'} iters={args.iters}")
    print(render(rows, budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
