"""`cfp` command line: one subcommand module per mode, each exposing `add_parser(subparsers)` and `run(args)`.

Command lines are parsed only here; the library takes typed objects, though its own entry points also accept
the short texts people type ("2x4" for a `MeshSpec`, "2GB" for a memory budget), validated where they are
parsed. Every cfp error becomes a one-line message on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from cfp.errors import CfpError

# subcommand name -> module under cfp.cli; modules are imported lazily so `cfp --help` stays fast.
SUBCOMMANDS = {
    "analysis": "cfp.cli.analysis",
    "profile": "cfp.cli.search",
    "search": "cfp.cli.search",
    "enum-benchmark": "cfp.cli.search",
    "train": "cfp.cli.train",
    "launch": "cfp.cli.launch",
    "data": "cfp.cli.data",
    "plan": "cfp.cli.plan",
    "explain": "cfp.cli.explain",
    "diff": "cfp.cli.explain",
}


def _available():
    return {name: importlib.import_module(modname) for name, modname in SUBCOMMANDS.items()}


class OneLineParser(argparse.ArgumentParser):
    """Bad options give one line (`cfp MODE: error: ...`) and exit code 2, not a usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="cfp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    seen = set()
    for name, mod in _available().items():
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        mod.add_parser(sub)
    return parser



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CfpError as e:
        print(f"cfp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:        # file system: a path that cannot be read or written
        where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
        print(f"cfp {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"cfp {args.command}: error: invalid JSON: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cfp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
