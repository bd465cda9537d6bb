"""`cfp train`: heterogeneous hybrid 3D-parallel training (FlashFlex/HexiScale layouts).

Example (8 simulated CPU devices: pipeline 0 = TP2,TP1,TP1 stages, pipeline 1 = one TP4 stage)::

    cfp train --model llama2 --num-layers 4 --hetero-configs "[[2,1,1],[4]]" \
        --layer-partitions "[[2,1,1],[4]]" --global-batch-size 6 2 --chunks 3 1 --verify
"""
from __future__ import annotations

import argparse
import sys

from typing import Optional

from cfp.cli import common
from cfp.cli.flags import add_record_flags, record_values
from cfp.planner.layout_file import is_factory

DEFAULT_BATCH, DEFAULT_CHUNKS = [8], [1]    # per pipeline, without --layout


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train", help="train with a heterogeneous 3D-parallel layout (per-pipeline batch, per-stage TP)",
        description=__doc__.splitlines()[0],
        epilog="Multi-process: cfp launch --nprocs 2 --devices-per-proc 4 -- cfp train ... "
               "(each stage's devices must belong to one process; see cfp.runtime.launch for "
               "multi-host use).")
    p.add_argument("--layout", default=None, metavar="FILE",
                   help="a layout file from `cfp plan`: sets the model, config, schedule and layout flags")
    common.add_model(p, choices=("llama2", "gpt", "moe", "bert"), required=False, factories=True,
                     help="model (required unless --layout)")
    common.add_config(p)
    common.add_shape_overrides(p, dtype_help="compute dtype; parameters stay float32 master weights")
    _layout_options(p)
    common.add_schedule(p)
    p.set_defaults(schedule=None)     # given: every pipeline runs it; else a layout file's per-pipeline schedules
    common.add_recompute(p, "the layout file's per-stage choice (cfp plan --recompute), else none")
    common.add_steps(p)
    common.add_optimizer(p)
    common.add_seed(p)
    p.add_argument("--data", choices=("stdlib", "synthetic", "files"), default=None,
                   help="stdlib: the Python standard library's sources, byte-level (default; "
                        "synthetic for bert); files: --data-path; synthetic: random tokens")
    p.add_argument("--data-path", nargs="+", default=None, help="files or directories for --data files")
    _checkpoint_options(p)
    p.add_argument("--timeline-dir", default=None, help="write timeline.json and timeline.png here")
    p.add_argument("--verify", action="store_true",
                   help="replay the steps on one device; exit 1 if the error is above tolerance, "
                        "2 on NaN/Inf")
    p.add_argument("--verify-tol", type=common.positive_float, default=None,
                   help="verify tolerance (default 1e-4 for float32, 5e-2 for bfloat16)")
    _stage_plan_options(p)
    p.add_argument("--stop-after", type=common.positive_int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def _layout_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hetero-configs", "--hetero_configs", default=None,
                   help='per pipeline, the TP degree of each stage, e.g. "[[2,1,1],[4]]" (required '
                        'unless --layout)')
    p.add_argument("--layer-partitions", "--layer_partitions", default=None,
                   help='per pipeline, layers per stage (default: split evenly), e.g. "[[2,1,1],[4]]"')
    p.add_argument("--global-batch-size", "--global_batch_size", type=common.positive_int, nargs="+",
                   default=None, help="batch rows per pipeline (padded with the last value / cut; when not "
                                      f"given: {DEFAULT_BATCH}, or the --layout file's)")
    p.add_argument("--chunks", "--micro_batch_num", type=common.positive_int, nargs="+", default=None,
                   help="micro-batches per pipeline (padded with the last value / cut; when not given: "
                        f"{DEFAULT_CHUNKS}, or the --layout file's)")
    p.add_argument("--devices-id", "--devices_id", default=None,
                   help='per pipeline, per stage, device ids (default: packed), e.g. "[[[0,1],[2]]]"')


def _checkpoint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", default=None,
                   help="where --checkpoint-every saves, --resume reads and --stage-plans search keeps its "
                        "plans (checksummed checkpoints)")
    p.add_argument("--checkpoint-every", type=common.non_negative_int, default=0,
                   help="save every K steps (needs --checkpoint-dir; 0: never)")
    p.add_argument("--keep-checkpoints", type=common.non_negative_int, default=common.DEFAULT_KEEP_CHECKPOINTS,
                   help="keep the newest N checkpoints, prune older ones (0: keep all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir; refused if there is "
                        "none, if it is corrupt or if it was written with other model, data or "
                        "optimizer settings (another layout is resharded)")


def _stage_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage-plans", default="megatron", metavar="megatron|search|DIR",
                   help="per-stage sharding: Megatron rules, a CFP search per stage (kept in "
                        "CHECKPOINT_DIR/stage_plans when --checkpoint-dir is given), or a directory of saved "
                        "stage plans")
    p.add_argument("--stage-memory", default=None, help="per-device memory budget of the stage search, "
                   "e.g. 2GB (default: unbounded)")
    common.add_gpu(p, None, "GPU of the stage search's estimate profiler (--stage-profiler estimate)")
    # the stage search's other options: cfp search's flags, named --stage-..., from the same records
    from cfp.profiling.options import ProfileOptions
    from cfp.search.options import SearchOptions
    add_record_flags(p, ProfileOptions, skip=("gpu", "progress"), prefix="stage")
    add_record_flags(p, SearchOptions, skip=("memory_per_device",), prefix="stage")


def parse_nested_list(text: str, name: str):
    """A flag's Python list literal such as ``"[[2,1,1],[4]]"`` (trailing commas allowed)."""
    import ast

    from cfp.errors import ConfigError
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--{name.replace('_', '-')}={text!r} is not a list literal, e.g. \"[[2,1,1],[4]]\"") \
            from None
    return list(value) if isinstance(value, tuple) else value


def _even_partition(rows, num_layers: int) -> list[list[int]]:
    from cfp.errors import ConfigError
    if isinstance(rows, list) and rows and all(isinstance(v, int) for v in rows):
        rows = [rows]
    out = []
    for row in rows if isinstance(rows, list) else [rows]:
        n = len(row) if isinstance(row, (list, tuple)) else 0
        if n == 0 or n > num_layers:
            raise ConfigError(f"cannot split {num_layers} layers evenly over stages {row!r}; pass "
                              "--layer-partitions")
        out.append([num_layers // n + (1 if i < num_layers % n else 0) for i in range(n)])
    return out


def _stage_plans(args: argparse.Namespace):
    from cfp.profiling.options import ProfileOptions
    from cfp.runtime.stage.plans import StagePlanOptions
    from cfp.search.options import SearchOptions
    given = {**record_values(ProfileOptions, args, "stage"), **record_values(SearchOptions, args, "stage"),
             "memory_per_device": args.stage_memory, "gpu": args.gpu}
    return StagePlanOptions.parse(args.stage_plans,
                                  SearchOptions().replace(**{k: v for k, v in given.items() if v is not None}))


LAYOUT_FLAGS = ("hetero_configs", "layer_partitions", "devices_id")
LIST_FLAGS = ("global_batch_size", "chunks")        # per pipeline, given as numbers
MODEL_FLAGS = ("model", "num_layers", "seq_len", "dtype")


def layout_from_args(args: argparse.Namespace, num_layers: Optional[int] = None):
    """(model config, config overrides, `Layout`) of the train arguments: the layout file's own `Layout` when
    --layout is given (layout flags given as well must describe the same layout), else the layout flags'. A
    user's model (a factory) has no config: ``num_layers`` is its layer count."""
    from cfp.errors import ConfigError
    from cfp.layout import Layout
    from cfp.models import get_config
    if args.layout:
        return _file_layout(args)
    missing = [f"--{n.replace('_', '-')}" for n in ("model", "hetero_configs") if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} required unless --layout FILE is given")
    overrides = {k: v for k, v in (("num_layers", args.num_layers), ("seq_len", args.seq_len),
                                   ("dtype", args.dtype)) if v}
    config = None if num_layers is not None else get_config(args.model, args.config, **overrides)
    lists = {n: parse_nested_list(getattr(args, n), n) for n in LAYOUT_FLAGS if getattr(args, n) is not None}
    if "layer_partitions" not in lists:
        lists["layer_partitions"] = _even_partition(lists["hetero_configs"],
                                                    num_layers if config is None else config.num_layers)
    layout = Layout.from_lists(global_batch_size=args.global_batch_size or DEFAULT_BATCH,
                               chunks=args.chunks or DEFAULT_CHUNKS, **lists)
    return config, overrides, layout


def _file_layout(args: argparse.Namespace):
    """`layout_from_args` of a --layout file: its model, config, schedule and `Layout` as loaded."""
    from cfp.errors import ConfigError
    from cfp.models import get_config
    from cfp.planner.layout_file import load_layout_file
    lf = load_layout_file(args.layout)
    filed = {"model": lf.model, **{k: lf.overrides.get(k) for k in MODEL_FLAGS[1:]}}
    if is_factory(lf.model) and args.model is not None and args.model != lf.model:
        raise ConfigError(f"--model={args.model} conflicts with layout file {args.layout!r} (model {lf.model}); "
                          "drop the flag or the file")
    for name in MODEL_FLAGS:
        given = getattr(args, name, None)
        if given is not None and given != filed[name]:
            raise ConfigError(f"--{name.replace('_', '-')}={given} conflicts with layout file {args.layout!r} "
                              f"({name} {filed[name]}); drop the flag or the file")
    _check_layout_flags(args, lf.layout)
    args.filed_recompute = lf.recompute
    # each pipeline runs the schedule its plan priced it with, virtual stages included (`schedule` holds the name
    # only); --schedule on the command line overrides them all
    args.model = lf.model
    if args.schedule is None:
        args.filed_schedules = lf.schedules
        args.schedule = lf.schedules[0] if lf.schedules else lf.schedule.value
    if is_factory(lf.model):
        return None, {}, lf.layout
    args.config = lf.config
    overrides = {k: v for k, v in lf.overrides.items() if v is not None}
    return get_config(lf.model, lf.config, **overrides), overrides, lf.layout


def _check_layout_flags(args: argparse.Namespace, filed) -> None:
    """Layout flags beside --layout are compared as layouts: the file's lists with the flags' in their place
    must give the file's layout (machine annotations aside)."""
    from cfp.errors import ConfigError
    from cfp.layout import Layout
    given = {n: parse_nested_list(getattr(args, n), n) for n in LAYOUT_FLAGS if getattr(args, n) is not None}
    given.update({n: getattr(args, n) for n in LIST_FLAGS if getattr(args, n) is not None})
    if not given:
        return
    try:
        flagged = Layout.from_lists(**{**filed.lists(), **given})
    except ConfigError as e:
        flagged = e
    if not isinstance(flagged, Layout) or not flagged.same_run(filed):
        flags = " ".join(f"--{n.replace('_', '-')} " + (" ".join(map(str, getattr(args, n))) if n in LIST_FLAGS
                                                         else repr(getattr(args, n))) for n in given)
        got = flagged.summary(devices=True) if isinstance(flagged, Layout) else f"an invalid layout ({flagged})"
        raise ConfigError(f"{flags} give {got}, but layout file {args.layout!r} has layout "
                          f"{filed.summary(devices=True)}; drop the flags or the file")


ZOO_ONLY = (("config", common.DEFAULT_CONFIG), ("num_layers", None), ("seq_len", None), ("dtype", None),
            ("lr", common.DEFAULT_LR), ("weight_decay", common.DEFAULT_WEIGHT_DECAY), ("data", None),
            ("data_path", None))


def _user_model(args: argparse.Namespace):
    """The factory's `UserModel` (after JAX is up); the zoo's options are an error beside it."""
    from cfp.cli.factory import load_factory
    from cfp.errors import ConfigError
    given = [f"--{k.replace('_', '-')}" for k, default in ZOO_ONLY if getattr(args, k, default) != default]
    if given:
        raise ConfigError(f"{', '.join(given)} apply to the zoo's models only; --model {args.model} (a factory) "
                          "gives its own model, data and optimizer")
    return load_factory(args.model)


def run(args: argparse.Namespace) -> int:
    from cfp.runtime.launch import check_layout_fills_processes, maybe_initialize_distributed
    user = args.model is not None and is_factory(args.model) or (
        args.layout and is_factory(_peek_model(args.layout)))
    if not user:
        config, overrides, layout = layout_from_args(args)
        check_layout_fills_processes(list(layout.devices))  # no rank left idle
    common.check_outputs(args, dirs={"timeline_dir": "--timeline-dir", "checkpoint_dir": "--checkpoint-dir"})
    maybe_initialize_distributed()  # before any device use
    common.ensure_host_devices(8)

    from cfp.runtime.training import DataSource, RunOptions, TrainOptions, run_training, train_user_model

    run_args = dict(
        schedule=args.schedule or common.DEFAULT_SCHEDULE, schedules=getattr(args, "filed_schedules", ()),
        steps=args.steps, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints or None,
        resume=args.resume, timeline_dir=args.timeline_dir, verify=args.verify, verify_tol=args.verify_tol,
        stop_after=args.stop_after, stage_plans=_stage_plans(args), tables=args.schedule_tables,
        recompute=_recompute(args))
    if user:
        um = _user_model(args)
        _, _, layout = layout_from_args(args, um.model.num_layers)
        run_args.update(recompute=_recompute(args), schedule=args.schedule or common.DEFAULT_SCHEDULE,
                        schedules=getattr(args, "filed_schedules", ()))
        check_layout_fills_processes(list(layout.devices))
        work = lambda: train_user_model(um, RunOptions(layout=layout, **run_args))
    else:
        data = DataSource(args.data) if args.data else (
            DataSource.SYNTHETIC if args.model == "bert" else DataSource.STDLIB)
        opts = TrainOptions(
            model=args.model, layout=layout, config_name=args.config, overrides=overrides,
            learning_rate=args.lr, weight_decay=args.weight_decay, seed=args.seed, data=data,
            data_paths=tuple(args.data_path or ()), **run_args)
        work = lambda: run_training(opts)
    result = _guarded(work)
    sys.stdout.flush()
    return 0 if result.verify_ok else 1


def _recompute(args: argparse.Namespace):
    """--recompute, or with auto the layout file's per-stage policies where it gives them."""
    filed = getattr(args, "filed_recompute", ())
    return filed if args.recompute == "auto" and filed else args.recompute


def _peek_model(path: str) -> str:
    from cfp.planner.layout_file import load_layout_file
    return load_layout_file(path).model


def _guarded(work):
    """Run ``work()``, turning a full disk or a dead peer into one-line errors."""
    import jax
    from cfp.errors import CfpError
    try:
        return work()
    except OSError as e:  # e.g. a full disk while saving; the paths themselves are checked up front
        raise CfpError(f"{e.strerror or e}: {e.filename!r}" if e.filename else str(e)) from None
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        # a collective with a dead or unreachable peer fails here instead of hanging
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CfpError(f"process {jax.process_index()}: a cross-process transfer failed (did "
                       f"another process die?): {first[:300]}") from None
