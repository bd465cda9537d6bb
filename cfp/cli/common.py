"""Options shared by the analysis/profile/search modes, and building the model's train step from them."""
from __future__ import annotations

import argparse
import os

from cfp.errors import ConfigError
from cfp import files
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


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    v = _int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be a positive integer")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be a non-negative integer")
    return v


def check_output_dir(path: str | None, flag: str) -> None:
    """Fail fast (before any capture or profiling) when directory `path` could not be created or written."""
    if path:
        files.check_output_dir(path, flag)


def check_output_file(path: str | None, flag: str) -> None:
    """Fail fast when file `path` could not be written (its directory is checked as `check_output_dir`)."""
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a directory; give a file path such as {os.path.join(path, 'plan.json')!r}")
    check_output_dir(os.path.dirname(os.path.abspath(os.path.expanduser(path))), flag + " directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path!r} exists and is not writable")


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, choices=MODEL_NAMES, help="model family")
    p.add_argument("--config", default="tiny", help="named config of the model (default: tiny)")
    p.add_argument("--num-layers", "--num_layer", dest="num_layers", type=positive_int, default=None,
                   help="number of transformer layers (default: the config's)")
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=positive_int, default=16)
    p.add_argument("--mesh", default="8", help="logical mesh: N (1-D) or AxB (2-D), e.g. 8 or 2x4")
    p.add_argument("--dump-dir", default=None, help="directory for the mode's dump files")


def build_step(args: argparse.Namespace, abstract: bool = False):
    """(step_fn, example_args, mesh_spec) of the model's optax AdamW train step on the requested mesh.

    With `abstract`, parameters and optimizer state are shape/dtype stand-ins (enough for the analysis).
    """
    import jax

    from cfp.mesh import MeshSpec
    from cfp.models import get_config, train_step

    mesh = MeshSpec.parse(args.mesh, num_devices=jax.device_count())
    if args.batch_size % mesh.size:
        raise ConfigError(f"batch size {args.batch_size} cannot be split over mesh {args.mesh} ({mesh.size} "
                          f"devices); use a multiple of {mesh.size}")
    overrides = dict(getattr(args, "overrides", None) or {})     # typed field overrides (compare.py --override)
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    config = get_config(args.model, args.config, **overrides)
    ts = train_step(args.model, config)
    # eager Flax init runs op by op (slow); one compiled call is fast, and analysis needs no values at all
    params, opt_state = (jax.eval_shape(ts.init, jax.random.PRNGKey(0)) if abstract
                         else jax.jit(ts.init)(jax.random.PRNGKey(0)))
    batch = ts.make_batch(args.batch_size, jax.random.PRNGKey(1))
    return ts.step, (params, opt_state, batch), mesh
