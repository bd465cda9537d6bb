"""What XLA's C++ code logs while compiling, and the SPMD partitioner's involuntary rematerializations in it.

XLA's SPMD partitioner partitions the program after sharding propagation by Shardy (JAX's default) or GSPMD
(`jax_use_shardy_partitioner=False`), and logs the same warning under both; only the shardings in it are
written differently: `{mesh['x'=2,'y'=4], [{'x', 'y'}, {}]}` under Shardy, `{devices=[8,1]<=[8]}` under GSPMD.

XLA writes its warnings to the process's stderr file descriptor, past Python's `sys.stderr`, so `capture_log`
points descriptor 2 at a temporary file around a compile and then writes everything it caught back to stderr:
nothing is hidden, and cfp can read what XLA said about the program it just compiled. Around the many
candidate compiles of a search, `quiet_compiles` keeps XLA's lines in a file and prints one summary line.
A program loaded from JAX's persistent compilation cache is not compiled, so XLA says nothing about it: given
the program, `capture_log` keeps what XLA logged compiling it beside that cache and reads it back
when the program is loaded; a program it has no such record of is compiled with the cache off, so its log is seen.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import sys
import tempfile
import threading
from typing import Iterator

import jax
import jaxlib
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from cfp.files import write_text_atomic

# one thread captures at a time (descriptor 2 is shared by the process); nested captures pass their text
# on to the enclosing one
_LOCK = threading.RLock()

_REMAT = re.compile(r"Involuntary full rematerialization\. The compiler cannot go from sharding (\{.*?\}) "
                    r"to (\{.*?\}) efficiently for HLO operation %([\w.\-]+) = (\w+\[[\d,]*\])")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Rematerialization:
    """One "[SPMD] Involuntary full rematerialization": XLA replicated a tensor to reshard it."""

    source: str        # HLO sharding it had, e.g. {mesh['x'=2,'y'=4], [{'x', 'y'}, {}]} or {devices=[8,1]<=[8]}
    target: str        # HLO sharding it was needed in
    operation: str     # HLO instruction name
    shape: str         # per-device shape of that instruction, e.g. f32[2,64]
    op_name: str       # its metadata op_name (carries cfp's named scopes)


@dataclasses.dataclass
class XlaLog:
    """Text XLA logged during a `capture_log` block (filled in when the block ends)."""

    text: str = ""

    @property
    def rematerializations(self) -> tuple[Rematerialization, ...]:
        return involuntary_rematerializations(self.text)


def involuntary_rematerializations(text: str) -> tuple[Rematerialization, ...]:
    """Every involuntary full rematerialization that XLA's SPMD partitioner reported in `text`."""
    out = []
    for line in text.splitlines():
        m = _REMAT.search(line)
        if m:
            name = _OP_NAME.search(line, m.end())
            out.append(Rematerialization(*m.groups(), name.group(1) if name else ""))
    return tuple(out)


@contextlib.contextmanager
def _persistent_cache_off() -> Iterator[None]:
    """JAX's persistent compilation cache (`jax_compilation_cache_dir`) off inside the block, so every program
    is compiled and XLA logs what it does; on again after it. Held under `_LOCK` by the caller."""
    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()       # JAX decides once whether the cache is used; ask it again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        reset_cache()


def program_key(lowered) -> str:
    """What decides XLA's log of compiling `lowered` (a `jax.stages.Lowered`): its program text, the XLA flags,
    the jax and jaxlib versions and the backend."""
    h = hashlib.sha256()
    for part in (lowered.as_text(), os.environ.get("XLA_FLAGS", ""), jax.__version__, jaxlib.__version__,
                 jax.default_backend()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _record_path(lowered) -> str | None:
    """Where XLA's log of compiling `lowered` is kept: beside JAX's persistent cache when it is on (and local);
    the program's key is computed only then."""
    root = jax.config.jax_compilation_cache_dir
    if lowered is None or not jax.config.jax_enable_compilation_cache or not root or "://" in root:
        return None
    return os.path.join(root, "cfp-xla-logs", f"{program_key(lowered)}.log")


def _read_record(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _keep_record(path: str | None, text: str) -> None:
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text_atomic(path, text)


@contextlib.contextmanager
def _descriptor_2_caught(caught: list[bytes], cache_off: bool = False) -> Iterator[None]:
    """Descriptor 2 goes to a temporary file inside the block (with `cache_off`, JAX's persistent cache off too);
    its bytes are appended to `caught` once the descriptor is back. The lock is held throughout: another thread
    swapping descriptor 2 meanwhile would restore it wrongly."""
    off = _persistent_cache_off() if cache_off else contextlib.nullcontext()
    with _LOCK, tempfile.TemporaryFile() as tmp, off:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            caught.append(tmp.read())


@contextlib.contextmanager
def capture_log(lowered=None) -> Iterator[XlaLog]:
    """Catch what is written to descriptor 2 inside the block (XLA's log), then write it back to stderr.

    `lowered`: the `jax.stages.Lowered` program compiled in the block. With JAX's persistent cache on, XLA's
    lines of a program compiled here are kept under its `program_key`; a program recorded so may be loaded from
    the cache, and when XLA says nothing the recorded lines stand for what it said compiling it (written back
    like them). A program not recorded is compiled with the cache off. Without `lowered` the cache is off in
    the block."""
    log, caught = XlaLog(), []
    record = _record_path(lowered)
    known = _read_record(record)
    with _LOCK:     # (re-entrant) until the text is written back, as no other thread may swap descriptor 2
        ok = False
        try:
            with _descriptor_2_caught(caught, cache_off=known is None):
                yield log
            ok = True
        finally:
            text = caught[0].decode(errors="replace")
            xla = split_xla_lines(text)[0]
            if ok and known is not None and not xla:
                text += known            # loaded from the cache: XLA's lines of when it was compiled
            elif ok and (xla or known is None):
                _keep_record(record, "".join(line + "\n" for line in xla))
            if text:
                os.write(2, text.encode())
            log.text = text


# a line of XLA's C++ log (absl/glog format: severity, date, time, thread, file:line]) or absl's preamble
_XLA_LINE = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]|WARNING: All log messages before absl)")


@dataclasses.dataclass
class QuietLog:
    """What XLA logged inside a `quiet_compiles` block (filled in when it ends); `what` names the compiles in
    the summary line (the block may update it, e.g. with their count once known)."""

    what: str = "candidate compiles"
    lines: int = 0                  # XLA log lines caught
    remats: int = 0                 # involuntary full rematerializations among them
    path: str | None = None         # file holding them (None when XLA logged nothing)

    def summary(self) -> str:
        if not self.lines:
            return f"{self.what}: XLA logged nothing"
        return (f"{self.what} printed {self.lines} XLA log lines ({self.remats} involuntary full rematerializations); "
                f"see {self.path}")


def split_xla_lines(text: str) -> tuple[list[str], list[str]]:
    """(XLA's log lines, every other line) of text written to descriptor 2."""
    xla, other = [], []
    for line in text.splitlines():
        (xla if _XLA_LINE.match(line) else other).append(line)
    return xla, other


@contextlib.contextmanager
def quiet_compiles(what: str = "candidate compiles", log_dir: str | None = None) -> Iterator[QuietLog]:
    """Keep XLA's C++ log off the terminal around candidate compiles: descriptor 2 goes to a temporary file
    in the block; XLA's lines are then kept in a file (in `log_dir`, default the temporary directory) and
    summarised in one line on stderr, while every other line written there goes back to stderr unchanged.
    Nested `capture_log` blocks still read XLA's text, so each verified plan keeps its own count
    (`ShardedStep.rematerializations`); other programs loaded from JAX's persistent cache log nothing here."""
    out, caught = QuietLog(what), []
    with _LOCK:     # (re-entrant) until the lines are written back, as in `capture_log`
        try:
            with _descriptor_2_caught(caught):
                yield out
        finally:
            xla, other = split_xla_lines(caught[0].decode(errors="replace"))
            if other:
                sys.stderr.write("\n".join(other) + "\n")
            if xla:
                fd, out.path = tempfile.mkstemp(prefix="cfp_xla_", suffix=".log", dir=log_dir)
                with os.fdopen(fd, "w") as f:
                    f.write("\n".join(xla) + "\n")
                out.lines, out.remats = len(xla), len(involuntary_rematerializations("\n".join(xla)))
                sys.stderr.write(out.summary() + "\n")
                sys.stderr.flush()
