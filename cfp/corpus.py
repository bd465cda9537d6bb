"""Byte-level text corpus: every byte is a token (vocab 256), so no tokenizer or download is needed. At the floor:
the runtime (`--data stdlib|files`) and the data pass both read it.

Batches are random windows drawn with a generator seeded by (seed, step), so a run is reproducible and a
restarted run sees the same data at the same step without storing a data-loader state.
"""
from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np

from cfp.errors import ConfigError

# files that are not source text; skipped when a directory is expanded
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def _expand(paths: Iterable[str | os.PathLike], suffixes: Sequence[str] | None,
            skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Files named by `paths` (directories walked recursively, leaving out `_SKIP_DIRS` and `skip`), in a
    deterministic sorted order."""
    out: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and d not in skip)
                out.extend(os.path.join(root, f) for f in sorted(files)
                           if suffixes is None or f.endswith(tuple(suffixes)))
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise ConfigError(f"corpus path {p!r} does not exist (give files or directories)")
    return out


class ByteCorpus:
    """Concatenated bytes of text files; `batch()` draws next-byte-prediction windows."""

    vocab_size = 256

    def __init__(self, data: np.ndarray, seq_len: int, seed: int = 0, num_files: int = 0, source: str = ""):
        if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ConfigError(f"seq_len={seq_len!r} is invalid (must be a positive integer)")
        data = np.asarray(data, dtype=np.uint8).reshape(-1)
        if data.size < seq_len + 1:
            raise ConfigError(
                f"corpus {source or '<array>'} has {data.size} bytes, fewer than seq_len+1={seq_len + 1} "
                "(give more text or a shorter seq_len)")
        self.data = data
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.num_files = num_files
        self.source = source

    @classmethod
    def from_paths(cls, paths: Iterable[str | os.PathLike] | str | os.PathLike, seq_len: int, seed: int = 0,
                   max_bytes: int | None = None, suffixes: Sequence[str] | None = None) -> "ByteCorpus":
        """Corpus of the given files (directories are walked, files sorted); files joined by a newline."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = list(paths)
        files = _expand(paths, suffixes)
        if not files:
            raise ConfigError(f"no corpus files found in {[os.fspath(p) for p in paths]!r}"
                              + (f" with suffixes {list(suffixes)}" if suffixes else ""))
        chunks, total = [], 0
        for f in files:
            with open(f, "rb") as fh:
                b = fh.read() if max_bytes is None else fh.read(max_bytes - total)
            chunks.append(b + b"\n")
            total += len(b) + 1
            if max_bytes is not None and total >= max_bytes:
                break
        data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        if max_bytes is not None:
            data = data[:max_bytes]
        src = os.fspath(paths[0]) if len(paths) == 1 else f"{len(paths)} paths"
        return cls(data, seq_len, seed, num_files=len(chunks), source=src)

    @classmethod
    def from_python_stdlib(cls, seq_len: int, seed: int = 0, max_bytes: int = 8_000_000) -> "ByteCorpus":
        """The `.py` files of the running Python's standard library (about 8 MB of real code by default)."""
        stdlib = sysconfig.get_paths()["stdlib"]
        return cls.from_paths([stdlib], seq_len, seed, max_bytes=max_bytes, suffixes=(".py",))

    def __len__(self) -> int:
        return int(self.data.size)

    def __repr__(self) -> str:
        return (f"ByteCorpus({len(self)} bytes from {self.num_files} files of {self.source!r}, "
                f"seq_len={self.seq_len}, seed={self.seed})")

    def batch(self, batch_size: int, step: int) -> dict[str, np.ndarray]:
        """`batch_size` windows for `step`: inputs/targets int32[B,S] (targets shifted by one), weights 1."""
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} is invalid (must be a positive integer)")
        if step < 0:
            raise ConfigError(f"step={step!r} is invalid (must be >= 0)")
        rng = np.random.default_rng([self.seed, int(step)])
        starts = rng.integers(0, len(self) - self.seq_len, size=batch_size)  # window start in [0, n-S-1]
        win = self.data[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": win[:, :-1], "targets": win[:, 1:],
                "weights": np.ones((batch_size, self.seq_len), np.float32)}

    @staticmethod
    def encode(text: str) -> np.ndarray:
        """UTF-8 bytes of `text` as int32 token ids."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    @staticmethod
    def decode(ids) -> str:
        """Token ids back to text (invalid UTF-8 replaced)."""
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")
