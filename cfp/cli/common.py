"""What the commands share: argparse types, the shared options and their defaults, the output-path checker,
and building a model's train step from the analysis/profile/search options."""
from __future__ import annotations

import argparse
import math
import os

from cfp import files
from cfp.errors import ConfigError
from cfp.hardware.gpus import DEFAULT_GPU
from cfp.models.configs import MODEL_NAMES


def ensure_host_devices(n: int = 8) -> None:
    """Simulate `n` CPU devices unless the user chose otherwise; must run before JAX initialises."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={n}").strip()


def patient_collectives(seconds: int = 600) -> None:
    """Let CPU collectives wait `seconds` for every device thread (XLA aborts the process after 40 s by
    default, which an oversubscribed machine running 8 simulated devices can exceed); before JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_call_terminate_timeout_seconds" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_cpu_collective_call_terminate_timeout_seconds={seconds}").strip()


# Defaults of the options several commands share (`train`, `plan`, `data`, `profile`/`search`): their one home,
# stated in docs/commands.md ("Options shared by several commands"). The `add_*` helpers below are the options'
# one definition.
DEFAULT_CONFIG = "tiny"
DEFAULT_SCHEDULE = "1f1b"      # the planner's cost model and the README's runs; GPipe holds all activations
DEFAULT_STEPS = 5
DEFAULT_LR = 1e-3
DEFAULT_WEIGHT_DECAY = 0.01
DEFAULT_SEED = 0
DEFAULT_CATALOG_GPU = DEFAULT_GPU     # where a command needs some GPU of the catalog for its estimates
DEFAULT_KEEP_CHECKPOINTS = 3
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")   # the registry's (`cfp.schedules.registry`)
DTYPES = ("float32", "bfloat16")


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def integer(text: str) -> int:
    """argparse type: any integer (the same message as the others for a non-integer)."""
    return _number(text, int)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (one message for 0 and for negative values)."""
    v = _number(text, int)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be a positive integer (1 or more)")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _number(text, int)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be an integer >= 0")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    v = _number(text, float)
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return v


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    v = _number(text, float)
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return v


# ----------------------------------------------------------------------------- output paths


def check_output_dir(path: str | None, flag: str) -> None:
    """Fail fast (before any work) when directory `path` could not be created or written: one line naming
    `flag` and the path."""
    if path:
        files.check_output_dir(path, flag)


def check_output_file(path: str | None, flag: str) -> None:
    """Fail fast (before any work) when file `path` could not be written."""
    if path:
        files.check_output_file(path, flag)


def check_outputs(args: argparse.Namespace, files_: dict[str, str] | None = None,
                  dirs: dict[str, str] | None = None) -> None:
    """The one checker of a command's output paths, run before any work: `files_` and `dirs` map an
    attribute of `args` to its flag (e.g. {"out": "--out"}); unset ones are skipped."""
    for attr, flag in (files_ or {}).items():
        check_output_file(getattr(args, attr, None), flag)
    for attr, flag in (dirs or {}).items():
        check_output_dir(getattr(args, attr, None), flag)


# ----------------------------------------------------------------------------- shared options


def add_model(p: argparse.ArgumentParser, choices=MODEL_NAMES, required: bool = True, help: str = "model family",
              default: str | None = None, factories: bool = False) -> None:
    """--model: a zoo name of `choices`; with `factories` also a user's ``module.path:factory`` or
    ``file.py:factory`` (`cfp.cli.factory`)."""
    if not factories:
        p.add_argument("--model", required=required, default=default, choices=choices, help=help)
        return

    def model(text: str) -> str:
        if ":" in text or text in choices:
            return text
        raise argparse.ArgumentTypeError(f"{text!r} is neither a model of the zoo ({', '.join(choices)}) nor a "
                                         "factory module.path:factory or file.py:factory")
    p.add_argument("--model", required=required, default=default, type=model, metavar="MODEL",
                   help=f"{help}: {', '.join(choices)}, or a factory module.path:factory / file.py:factory returning "
                        "(cfp.LayeredModel, batch, optax optimizer)")


def add_config(p: argparse.ArgumentParser, default: str = DEFAULT_CONFIG) -> None:
    p.add_argument("--config", default=default, help="named config of the model")


def add_shape_overrides(p: argparse.ArgumentParser, dtype_help: str = "compute dtype") -> None:
    """--num-layers, --seq-len and --dtype: overrides of the named config's values."""
    add_num_layers(p)
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length (default: the config's)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help=f"{dtype_help} (default: the config's)")


def add_num_layers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-layers", "--num_layer", dest="num_layers", type=positive_int, default=None,
                   help="number of transformer layers (default: the config's)")


RECOMPUTE = ("auto", "none", "selective", "full")     # `cfp.recompute.Recompute`'s values


def add_recompute(p: argparse.ArgumentParser, help_auto: str) -> None:
    p.add_argument("--recompute", choices=RECOMPUTE, default="auto",
                   help="what each stage's backward recomputes of its forward: none (F keeps what the backward "
                        "needs), selective (keeps the dot outputs without batch dims; recomputes attention scores "
                        "and elementwise values), full (keeps the stage input only; the backward reruns the "
                        f"forward), auto: {help_auto} (default: %(default)s)")


def add_schedule(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", type=run_schedule_text, default=DEFAULT_SCHEDULE, metavar="SCHEDULE",
                   help="pipeline schedule the runtime runs: gpipe, 1f1b, interleaved (interleaved:V for V virtual "
                        "stages per stage, default 2), zb-h1 or zb-v")
    p.add_argument("--schedule-tables", choices=["generated", "pattern"], default="generated",
                   help="interleaved, zb-h1 and zb-v: run a table generated from each stage's F/B/W times, measured "
                        "in a pass of the first batch before the first step (within the memory the fixed pattern "
                        "keeps), or the fixed pattern (default: %(default)s)")


def run_schedule_text(text: str) -> str:
    """argparse type of a schedule to run: a schedule name or ``interleaved:V``."""
    from cfp.errors import ConfigError
    from cfp.schedules.registry import ScheduleSpec
    try:
        ScheduleSpec.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{e} (valid: {', '.join(SCHEDULES)} or interleaved:V with V >= 2)") \
            from None
    return text


def schedule_text(text: str) -> str:
    """argparse type of `cfp plan --schedule`: a schedule name, ``interleaved:V`` or ``auto``."""
    from cfp.errors import ConfigError
    from cfp.schedules.registry import schedule_choices
    try:
        schedule_choices(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{e}, interleaved:V or auto") from None
    return text


def add_plan_schedule(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", type=schedule_text, default=DEFAULT_SCHEDULE, metavar="SCHEDULE",
                   help="pipeline schedule to price: gpipe, 1f1b, interleaved (interleaved:V for V virtual stages "
                        "per stage, default 2), zb-h1, zb-v, or auto (each pipeline the fastest of 1f1b, "
                        "interleaved:2, zb-h1 and zb-v whose memory fits)")


def add_steps(p: argparse.ArgumentParser, help: str = "training steps") -> None:
    p.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, help=help)


def add_optimizer(p: argparse.ArgumentParser, weight_decay: bool = True) -> None:
    p.add_argument("--lr", type=positive_float, default=DEFAULT_LR, help="AdamW learning rate")
    if weight_decay:
        p.add_argument("--weight-decay", type=non_negative_float, default=DEFAULT_WEIGHT_DECAY,
                       help="AdamW weight decay")


def add_seed(p: argparse.ArgumentParser, help: str = "random seed of the parameters and data") -> None:
    p.add_argument("--seed", type=non_negative_int, default=DEFAULT_SEED, help=help)


def add_gpu(p: argparse.ArgumentParser, default: str | None, help: str) -> None:
    p.add_argument("--gpu", default=default, help=help + " (a name of `cfp.hardware.gpus`, e.g. A100-SXM-80G)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options of analysis, profile, search and enum-benchmark: a model's train step on a logical mesh."""
    add_model(p)
    add_config(p)
    add_num_layers(p)
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=positive_int, default=16,
                   help="global batch size of the train step")
    p.add_argument("--mesh", default="8", help="logical mesh: N (1-D) or AxB (2-D), e.g. 8 or 2x4")
    p.add_argument("--dump-dir", default=None, help="directory for the mode's dump files (default: none)")


def model_config(args: argparse.Namespace):
    """The model config the options name: `--config` with `--num-layers` (and compare.py's typed overrides)."""
    from cfp.models import get_config
    overrides = dict(getattr(args, "overrides", None) or {})     # typed field overrides (compare.py --override)
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    return get_config(args.model, args.config, **overrides)


def build_step(args: argparse.Namespace, abstract: bool = False):
    """(step_fn, example_args, mesh_spec) of the model's optax AdamW train step on the requested mesh.

    With `abstract`, parameters and optimizer state are shape/dtype stand-ins (enough for the analysis).
    """
    import jax

    from cfp.mesh import MeshSpec
    from cfp.models import train_step

    mesh = MeshSpec.parse(args.mesh, num_devices=jax.device_count())
    if args.batch_size % mesh.size:
        raise ConfigError(f"batch size {args.batch_size} cannot be split over mesh {args.mesh} ({mesh.size} "
                          f"devices); use a multiple of {mesh.size}")
    ts = train_step(args.model, model_config(args))
    # eager Flax init runs op by op (slow); one compiled call is fast, and analysis needs no values at all
    params, opt_state = (jax.eval_shape(ts.init, jax.random.PRNGKey(0)) if abstract
                         else jax.jit(ts.init)(jax.random.PRNGKey(0)))
    batch = ts.make_batch(args.batch_size, jax.random.PRNGKey(1))
    return ts.step, (params, opt_state, batch), mesh
