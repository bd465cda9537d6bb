"""What XLA's C++ code logs while compiling, and the SPMD partitioner's involuntary rematerializations in it.

XLA's SPMD partitioner partitions the program after sharding propagation by Shardy (JAX's default) or GSPMD
(`jax_use_shardy_partitioner=False`), and logs the same warning under both; only the shardings in it are
written differently: `{mesh['x'=2,'y'=4], [{'x', 'y'}, {}]}` under Shardy, `{devices=[8,1]<=[8]}` under GSPMD.

XLA writes its warnings to the process's stderr file descriptor, past Python's `sys.stderr`, so `capture_log`
points descriptor 2 at a temporary file around a compile and then writes everything it caught back to stderr:
nothing is hidden, and cfp can read what XLA said about the program it just compiled. Around the many
candidate compiles of a search, `quiet_compiles` keeps XLA's lines in a file and prints one summary line.
Both turn JAX's persistent compilation cache off inside the block: a program loaded from it is not compiled,
so XLA would say nothing about it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import threading
from typing import Iterator

import jax
from jax.experimental.compilation_cache.compilation_cache import reset_cache

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


@contextlib.contextmanager
def _descriptor_2_caught(caught: list[bytes]) -> Iterator[None]:
    """Descriptor 2 goes to a temporary file inside the block; its bytes are appended to `caught` once the
    descriptor is back. The lock is held throughout: another thread swapping descriptor 2 meanwhile would
    restore it wrongly."""
    with _LOCK, tempfile.TemporaryFile() as tmp, _persistent_cache_off():
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
def capture_log() -> Iterator[XlaLog]:
    """Catch what is written to descriptor 2 inside the block (XLA's log), then write it back to stderr."""
    log, caught = XlaLog(), []
    with _LOCK:     # (re-entrant) until the text is written back, as no other thread may swap descriptor 2
        try:
            with _descriptor_2_caught(caught):
                yield log
        finally:
            if caught[0]:
                os.write(2, caught[0])
            log.text = caught[0].decode(errors="replace")


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
    (`ShardedStep.rematerializations`)."""
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
