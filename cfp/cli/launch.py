"""`cfp launch`: run N ranks of a command as one JAX distributed job on this host (see cfp.runtime.launch)."""
from __future__ import annotations

import argparse

from cfp.errors import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="run N processes of a command as one multi-process JAX job",
        description="Spawn --nprocs copies of COMMAND with CFP_COORDINATOR, CFP_NUM_PROCESSES, CFP_PROCESS_ID "
                    "and CFP_DEVICES_PER_PROC set; the program calls "
                    "cfp.runtime.launch.maybe_initialize_distributed() before using JAX. "
                    "Example: cfp launch --nprocs 2 --devices-per-proc 4 -- python train.py")
    p.add_argument("--nprocs", type=int, required=True, help="processes to start on this host")
    p.add_argument("--devices-per-proc", type=int, default=1, help="simulated CPU devices per process")
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0's coordinator, for multi-host runs (instead of --port)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="total processes over all hosts (default: --nprocs)")
    p.add_argument("--first-rank", type=int, default=0, help="process id of this host's first process")
    p.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    p.add_argument("--log-dir", default=None, help="also write each rank's output to LOG_DIR/rank<i>.log")
    # dest is not "command": cfp.cli.main reads args.command as the subcommand's name for its errors
    p.add_argument("argv", metavar="COMMAND", nargs=argparse.REMAINDER, help="the command, after '--'")
    p.set_defaults(func=run)


def run(args) -> int:
    from cfp.runtime.launch import launch

    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command to launch (give it after '--', e.g. cfp launch --nprocs 2 -- python x.py)")
    return launch(command, args.nprocs, args.devices_per_proc, port=args.port, timeout=args.timeout,
                  coordinator=args.coordinator, num_processes=args.num_processes, first_rank=args.first_rank,
                  log_dir=args.log_dir)
