"""`cfp profile`, `cfp search` and `cfp enum-benchmark`: the profiling and search passes from the command line."""
from __future__ import annotations

import argparse
import itertools
import time

from cfp.cli.common import (DEFAULT_CATALOG_GPU, add_model_options, build_step, check_output_dir, check_output_file,
                            ensure_host_devices, model_config, positive_int)
from cfp.cli.flags import add_record_flags, record_from_args
from cfp.errors import ConfigError
from cfp.profiling.options import ProfilerKind


def _profile_options(p: argparse.ArgumentParser) -> None:
    """The profiling pass's flags, generated from `ProfileOptions` (defaults included), and its cache's."""
    from cfp.profiling.options import ProfileOptions
    add_record_flags(p, ProfileOptions)
    p.add_argument("--cache-dir", default=None, help="profile cache directory (default: ~/.cache/cfp/profiles)")
    p.add_argument("--no-cache", action="store_true", help="profile again, ignoring and not writing the cache")


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="profile every unique segment's strategy combinations")
    add_model_options(p)
    _profile_options(p)
    p.set_defaults(func=run_profile)

    s = sub.add_parser("search", help="profile, then search the fastest plan within a memory budget")
    add_model_options(s)
    _profile_options(s)
    from cfp.search.options import SearchOptions
    add_record_flags(s, SearchOptions)
    s.add_argument("--plan-out", default=None, help="write the chosen plan (JSON) here")
    s.set_defaults(func=run_search)

    e = sub.add_parser("enum-benchmark", help="every strategy combination of one segment: comm, compute, time, memory")
    add_model_options(e)
    e.add_argument("--segment", type=int, default=0, help="segment kind to enumerate (default 0)")
    e.add_argument("--gpu", default=DEFAULT_CATALOG_GPU, help="catalog GPU of the cost-model columns")
    e.add_argument("--iters", type=positive_int, default=3, help="timed runs per combination")
    e.add_argument("--limit", type=positive_int, default=16, help="at most this many combinations (in order)")
    e.set_defaults(func=run_enum)


def _popts(args):
    from cfp.profiling.options import ProfileOptions, default_cache_dir
    cache = None if args.no_cache else (args.cache_dir or default_cache_dir())
    return record_from_args(ProfileOptions, args, cache_dir=cache)


def search_options(args):
    """The `SearchOptions` of `cfp search`'s flags (each flag's default is the record's)."""
    from cfp.search.options import SearchOptions
    return record_from_args(SearchOptions, args, profile=_popts(args))


def _check_outputs(args) -> None:
    """Output paths are checked before any work, so a typo costs no capture or profiling."""
    check_output_dir(args.dump_dir, "--dump-dir")
    if not getattr(args, "no_cache", True):
        check_output_dir(args.cache_dir, "--cache-dir")
    check_output_file(getattr(args, "plan_out", None), "--plan-out")


def _prepare(args):
    _check_outputs(args)
    ensure_host_devices()
    popts = _popts(args)   # validate options before the (slow) capture
    from cfp.analysis.analysis import analyze_with_program
    step, example_args, mesh = build_step(args)
    analysis, program = analyze_with_program(step, mesh, *example_args)
    return popts, step, example_args, analysis, program


def _print_table(table, analysis) -> None:
    print(f"profiler: {table.profiler}  device: {table.device_kind}  jax {table.jax_version}  "
          f"compiles: {table.compiles}  from the cache: {len(table.reused)} of {len(table.segments)} segment kinds  "
          f"profile time: {table.profile_time:.2f} s")
    how = ("measured" if table.profiler.kind is ProfilerKind.MEASURE
           else f"estimated by the {table.profiler.gpu} cost model")
    print(f"time: {how}; memory: compiled on this host (arguments + outputs + temporaries)")
    for kind, seg in table.segments.items():
        print(f"segment kind {kind} ({seg.fingerprint}), space {list(seg.space)}: {seg.rule}")
        for e in seg.candidates(len(seg.entries)):
            print(f"  {list(e.choice)}  time {e.time * 1e3:9.3f} ms  memory {e.memory / 1e6:9.3f} MB  "
                  f"comm {e.comm_bytes / 1e6:8.3f} MB")


def run_profile(args) -> int:
    from cfp.profiling.profiler import profile
    from cfp.xla.log import quiet_compiles
    popts, _, _, analysis, program = _prepare(args)
    with quiet_compiles() as xla_log:
        table = profile(program, analysis, popts)
        xla_log.what = f"{table.compiles} candidate compiles"
    _print_table(table, analysis)
    _dump_table(table, args.dump_dir)
    return 0


def _dump_table(table, dump_dir) -> None:
    if dump_dir:
        import os
        os.makedirs(dump_dir, exist_ok=True)
        path = os.path.join(dump_dir, "profile_table.json")
        with open(path, "w") as f:
            f.write(table.to_json(indent=1))
        print(f"wrote {path}")


def run_search(args) -> int:
    from cfp.sharding.specs import resolve
    from cfp.profiling.profiler import profile
    from cfp.search.plan import make_plan
    from cfp.search.search import search
    t0 = time.perf_counter()
    sopts = search_options(args)
    from cfp.xla.log import quiet_compiles
    _, _, example_args, analysis, program = _prepare(args)
    with quiet_compiles() as xla_log:
        table = profile(program, analysis, sopts.profile)
        print(f"profiled {len(table.segments)} segment kinds in {table.profile_time:.2f} s "
              f"({table.compiles} compiles)")
        _dump_table(table, args.dump_dir)
        result = search(program, analysis, table, example_args, sopts)
        xla_log.what = f"{table.compiles} profile and {len(result.steps)} whole-step candidate compiles"
    print(result.report(*_labels(args, result)))
    print(_layer_flops_line(args, example_args, result))
    print(f"search time: {result.search_time:.2f} s; total planning time: {time.perf_counter() - t0:.2f} s")
    if args.plan_out:
        from cfp.report.estimates import model_metrics, with_estimates
        b = result.best
        metrics = {"time": b.time, "dp_time": b.dp_time, "memory": b.memory, "flops": b.flops,
                   "profiler": str(table.profiler), "config": args.config, "mesh": args.mesh,
                   **model_metrics(args.model, model_config(args), args.batch_size)}
        chosen = result.steps.get(b.key)     # a plain layout's or the ILP's step (issue 42); else resolved
        plan = make_plan(analysis, chosen.shardings if chosen is not None and b.layout
                         else resolve(analysis, result.choice, result.shard_state), metrics, layout=b.layout)
        # estimates on the searched GPU, else the catalog default (labelled in the plan and by `cfp explain`)
        with_estimates(plan, analysis, table, args.gpu or DEFAULT_CATALOG_GPU).save(args.plan_out)
        print(f"wrote {args.plan_out}")
    return 0


def _labels(args, result) -> tuple[str, str]:
    """How the printed time and memory were obtained (every figure says measured or estimated)."""
    if args.profiler != ProfilerKind.ESTIMATE.value:
        how = "measured on this host" if result.time_label == "measured" else result.time_label
        return how, "measured: compiled on this host"
    from cfp.hardware.gpus import get_gpu
    gpu = get_gpu(args.gpu)
    fits = "fits" if result.best.memory <= gpu.mem_gb * 1e9 else "does NOT fit"
    return (f"estimated: {gpu.name} cost model",
            f"estimated for {gpu.name}: arguments and outputs from their dtypes (same bytes on the GPU), "
            f"temporaries from XLA:CPU's buffer assignment of the same program; {fits} in {gpu.mem_gb:g} GB")


def _layer_flops_line(args, example_args, result) -> str:
    """CFP's FLOP count: 6·N·tokens over the transformer layers only (no LM head, no attention scores)."""
    import jax

    from cfp.models import get_config
    params = example_args[0]
    n_layer = sum(x.size for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
                  if "layers" in jax.tree_util.keystr(path))
    tokens = args.batch_size * get_config(args.model, args.config).seq_len
    flops = 6 * n_layer * tokens
    t = result.best.time
    how = "measured" if result.time_label == "measured" else "estimated"
    return (f"layer FLOPs (CFP's TFLOP_COUNT, 6 x {n_layer / 1e6:.4g}M layer params x {tokens} tokens): "
            f"{flops / 1e12:.6g} TFLOP; {flops / 1e12 / t if t > 0 else 0.0:.4g} TFLOP/s on the {how} time")


def run_enum(args) -> int:
    check_output_dir(args.dump_dir, "--dump-dir")
    ensure_host_devices()
    from cfp.analysis.analysis import analyze_with_program
    from cfp.profiling import gpu_estimate
    from cfp.hardware.gpus import get_gpu
    from cfp.profiling.options import ProfileOptions
    from cfp.profiling.profiler import Profiler
    gpu = get_gpu(args.gpu)
    step, example_args, mesh = build_step(args)
    analysis, program = analyze_with_program(step, mesh, *example_args)
    seg = next((s for s in analysis.segments if s.kind == args.segment), None)
    if seg is None:
        raise ConfigError(f"segment kind {args.segment} does not exist; kinds are 0..{analysis.num_unique_segments - 1}")
    space = [len(analysis.blocks[b].strategies) for b in seg.blocks]
    choices = list(itertools.islice(itertools.product(*[range(n) for n in space]), args.limit))
    print(f"segment kind {seg.kind} blocks {seg.start}..{seg.stop - 1}, space {space}; "
          f"enumerating {len(choices)} combinations; cost model: {gpu.name}")
    prof = Profiler(program, analysis, ProfileOptions(iters=args.iters, progress=False), log=lambda *_: None)
    dtype = gpu_estimate.dominant_dtype(analysis, seg.blocks)
    print(f"{'combination':<28} {'comm MB':>9} {'comm ms':>9} {'compute ms':>10} {'measured ms':>11} {'memory MB':>10}")
    for e in prof.profile_segment(seg, choices):
        ct = gpu_estimate.comm_time(e.collectives, gpu)
        cp = gpu_estimate.compute_time(e.flops, e.bytes_accessed, gpu, dtype)
        print(f"{str(list(e.choice)):<28} {e.comm_bytes / 1e6:9.3f} {ct * 1e3:9.4f} {cp * 1e3:10.4f} "
              f"{e.measured * 1e3:11.3f} {e.memory / 1e6:10.3f}")
    return 0
