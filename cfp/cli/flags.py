"""Command-line flags generated from an options record, so each flag's default (and the one `--help` shows) is
the record's own: every field with `help` metadata becomes `--field-name` (`--<flag>` where the metadata
names one), parsed to the field's type; a boolean that defaults on becomes `--no-field-name`. The record
validates the values in its `__post_init__` (a ConfigError: one line, exit 2). A `prefix` names the pass the
flags are for where a command runs several (`cfp train`'s stage search: `--stage-iters`)."""
from __future__ import annotations

import argparse
import dataclasses
import enum
import typing

from cfp.cli.common import integer


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


_PARSE = {int: integer, float: _number, str: str}


def _flag_fields(record: type, prefix: str = "") -> list[tuple[dataclasses.Field, str, type]]:
    """(field, its flag's name with dashes, ``prefix-`` first, its type without None) of every field of `record`
    that is a flag."""
    hints = typing.get_type_hints(record)
    out = []
    for f in dataclasses.fields(record):
        if "help" in f.metadata:
            kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
            flag = f.metadata.get("flag", f.name).replace("_", "-")
            out.append((f, f"{prefix}-{flag}" if prefix else flag, kind))
    return out


def add_record_flags(p: argparse.ArgumentParser, record: type, skip: tuple[str, ...] = (), prefix: str = "",
                     ) -> None:
    """Add a flag to `p` for every flag field of dataclass `record` (not those named in `skip`), its default
    the record's, its name ``--prefix-name`` where a `prefix` is given."""
    defaults = record()
    for f, flag, kind in _flag_fields(record, prefix):
        if f.name in skip:
            continue
        value, dest, text = getattr(defaults, f.name), flag.replace("-", "_"), f.metadata["help"]
        if kind is bool:
            if value:
                p.add_argument(f"--no-{flag}", dest=dest, action="store_false", help=f"turn off: {text} (default: on)")
            else:
                p.add_argument(f"--{flag}", dest=dest, action="store_true", help=f"{text} (default: off)")
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            p.add_argument(f"--{flag}", dest=dest, choices=[m.value for m in kind], default=value.value, help=text)
        else:
            parse = str if f.metadata.get("text") else _PARSE[kind]
            p.add_argument(f"--{flag}", dest=dest, type=parse, default=value, help=text)


def record_from_args(record: type, args: argparse.Namespace, prefix: str = "", **given):
    """`record` built from the flags `add_record_flags` added with `prefix` (those `args` has), and the fields in
    `given`."""
    return record(**{**record_values(record, args, prefix), **given})


def record_values(record: type, args: argparse.Namespace, prefix: str = "") -> dict:
    """The values of `record`'s fields that `args` has flags for (added by `add_record_flags` with `prefix`)."""
    return {f.name: getattr(args, flag.replace("-", "_")) for f, flag, _ in _flag_fields(record, prefix)
            if hasattr(args, flag.replace("-", "_"))}
