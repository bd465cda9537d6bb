"""Output files: checking a directory before any work starts, and atomic JSON writes (no run loses data)."""
from __future__ import annotations

import json
import os

from cfp.errors import ConfigError


def _writable_parent(full: str, path: str, name: str) -> str:
    """The nearest existing ancestor of `full`, checked to be a writable directory (else a ConfigError)."""
    parent = full
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{name}={path!r} cannot be created: {parent!r} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}={path!r} cannot be written: no write permission in {parent!r}")
    return parent


def check_output_dir(path: str, name: str) -> None:
    """Raise ConfigError unless `path` is, or can be created as, a writable directory; `name` is how the
    user gave it (a flag or an option name), so the message names it."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full) and not os.path.isdir(full):
        raise ConfigError(f"{name}={path!r} is not a directory: it is an existing file")
    _writable_parent(full, path, name)


def check_output_file(path: str, name: str) -> None:
    """Raise ConfigError unless file `path` can be written (created, or overwritten where it exists)."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        raise ConfigError(f"{name}={path!r} is a directory; give a file path such as "
                          f"{os.path.join(path, 'out.json')!r}")
    _writable_parent(os.path.dirname(full), path, name)
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise ConfigError(f"{name}={path!r} exists and is not writable")


def write_text_atomic(path, text: str) -> str:
    """Write `text` to `path` through a temporary file and a rename, so a crash leaves the old file (or none),
    never half a file; the temporary name carries the pid so two writers never share one."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:      # a failed write (disk full, interrupt) leaves no temporary file behind
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path, obj, indent: int | None = 1) -> str:
    """Write `obj` as JSON to `path` atomically (see `write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(obj, indent=indent))
