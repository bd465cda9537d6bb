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
    "explain": "cfp.cli.explain",
    "diff": "cfp.cli.explain",
    "plan": "cfp.cli.plan",
    "train": "cfp.cli.train",
    "launch": "cfp.cli.launch",
    "data": "cfp.cli.data",
}


def _available():
    return {name: importlib.import_module(modname) for name, modname in SUBCOMMANDS.items()}


USER_HELP = """\
cfp finds how to split a JAX training step over many devices, and runs it:
  * intra-operator parallelism (CFP): analyse a train step, profile its strategies, search the fastest plan
    within a memory budget, and explain or compare plans;
  * heterogeneous 3D parallelism (FlashFlex/HexiScale): plan a layout for a cluster of mixed GPUs and train
    with it, on one process or several;
  * variable-length data (Hydraulis): analyse sequence lengths, propose strategies, train with them.
Commands that run JAX simulate 8 CPU devices unless XLA_FLAGS sets another count."""

EPILOG = ("Run `cfp COMMAND --help` for a command's options and their defaults. docs/commands.md, in the "
          "source tree, describes every command and links to its examples in the user guide.")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states it; a flag's default
    (off) and a None default ("not given") go unsaid."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if ("default" in text or not action.option_strings or d is None or d is argparse.SUPPRESS
                or isinstance(d, bool)):
            return text
        shown = " ".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
        return f"{text} (default: {shown.replace('%', '%%')})"


class OneLineParser(argparse.ArgumentParser):
    """Bad options give one line (`cfp MODE: error: ...`) and exit code 2, not a usage dump; help texts
    show every option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib import metadata

    import cfp
    try:
        return metadata.version("cfp")
    except metadata.PackageNotFoundError:   # run from a source tree without installing
        return cfp.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="cfp", description=USER_HELP, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cfp {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands",
                                parser_class=OneLineParser)
    seen = set()
    for name, mod in _available().items():
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        mod.add_parser(sub)
    return parser



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:   # bad options (one line already printed), --help, --version: a return code
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    name = " ".join(n for n in (args.command, getattr(args, "data_command", None)) if n)   # e.g. "data train"
    try:
        return int(args.func(args) or 0)
    except CfpError as e:
        print(f"cfp {name}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:        # file system: a path that cannot be read or written
        where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
        print(f"cfp {name}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"cfp {name}: error: invalid JSON: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cfp {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
