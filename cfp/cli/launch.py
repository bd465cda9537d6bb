"""`cfp launch`: run N ranks of a command as one JAX distributed job on this host (see cfp.runtime.launch)."""
from __future__ import annotations

import argparse
import contextlib
import io
import os

from cfp.cli import common
from cfp.errors import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="run N processes of a command as one multi-process JAX job",
        description="Spawn --nprocs copies of COMMAND with CFP_COORDINATOR, CFP_NUM_PROCESSES, CFP_PROCESS_ID "
                    "and CFP_DEVICES_PER_PROC set; the program calls "
                    "cfp.runtime.launch.maybe_initialize_distributed() before using JAX. "
                    "Example: cfp launch --nprocs 2 --devices-per-proc 4 -- python train.py")
    p.add_argument("--nprocs", type=common.positive_int, required=True, help="processes to start on this host")
    p.add_argument("--devices-per-proc", type=common.positive_int, default=1,
                   help="simulated CPU devices per process")
    p.add_argument("--port", type=common.positive_int, default=None,
                   help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0's coordinator, for multi-host runs (instead of --port)")
    p.add_argument("--num-processes", type=common.positive_int, default=None,
                   help="total processes over all hosts (default: --nprocs)")
    p.add_argument("--first-rank", type=common.non_negative_int, default=0,
                   help="process id of this host's first process")
    p.add_argument("--timeout", type=common.positive_float, default=None,
                   help="stop everything after this many seconds (default: no limit)")
    p.add_argument("--log-dir", default=None, help="also write each rank's output to LOG_DIR/rank<i>.log")
    # dest is not "command": cfp.cli.main reads args.command as the subcommand's name for its errors
    p.add_argument("argv", metavar="COMMAND", nargs=argparse.REMAINDER, help="the command, after '--'")
    p.set_defaults(func=run)


def _cfp_train_args(command: list[str]) -> list[str] | None:
    """The `cfp train` arguments of `command` when it runs `cfp train` (as `cfp train ...` or
    `python -m cfp.cli.main train ...`), else None."""
    for i, word in enumerate(command[:-1]):
        is_cfp = os.path.basename(word) == "cfp" or (word == "cfp.cli.main" and i and command[i - 1] == "-m")
        if is_cfp:
            return command[i + 2:] if command[i + 1] == "train" else None
    return None


def _check_train_layout(command: list[str], args) -> None:
    """A `cfp train` job whose layout leaves a process without devices is refused before any rank starts."""
    train_args = _cfp_train_args(command)
    if train_args is None:
        return
    from cfp.cli.main import build_parser
    from cfp.cli.train import layout_from_args, parse_nested_list
    from cfp.planner.layout_file import is_factory
    from cfp.runtime.launch import check_layout_fills_processes
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = build_parser().parse_args(["train", *train_args])
    except SystemExit:        # bad train options: the ranks report them themselves
        return
    num_layers = None
    if parsed.model is not None and is_factory(parsed.model) and not parsed.layout:
        if parsed.layer_partitions is None:   # the layer count is the factory's own: each rank checks
            return
        num_layers = sum(parse_nested_list(parsed.layer_partitions, "layer_partitions")[0])
    _, _, layout = layout_from_args(parsed, num_layers)
    check_layout_fills_processes(list(layout.devices),
                                 args.num_processes or args.nprocs, args.devices_per_proc)


def run(args) -> int:
    from cfp.runtime.launch import launch

    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command to launch (give it after '--', e.g. cfp launch --nprocs 2 -- python x.py)")
    common.check_outputs(args, dirs={"log_dir": "--log-dir"})
    _check_train_layout(command, args)
    return launch(command, args.nprocs, args.devices_per_proc, port=args.port, timeout=args.timeout,
                  coordinator=args.coordinator, num_processes=args.num_processes, first_rank=args.first_rank,
                  log_dir=args.log_dir)
