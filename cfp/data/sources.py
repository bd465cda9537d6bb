"""Variable-length training sequences from real text: JSONL records, a folder of text files, or the Python
standard library's sources (the built-in corpus; its file lengths are long-tailed).

The unit of a sequence is a whole document (JSONL record or file), or with `Unit.DEFINITION` each top-level
`def`/`class` block of a Python file (with its decorators; the module header is one more block): the
standard library's definitions are long-tailed (median ~440 bytes, p99 ~27 KB), where its files (median
~6.8 KB) are too long for CPU training runs. DEFINITION is the default for "stdlib". With `Unit.DOCSTRING`
each docstring of a Python file (module, class, function) is a sequence: English prose (with some examples),
mostly short -- the standard library's have a median of ~90 bytes and a 99th percentile of ~1.7 KB -- a
second real-text corpus every Python install has.

Tokenisation is byte-level (vocab 256): a document of n bytes is one sequence of n-1 next-byte predictions.
A unit longer than `max_seq_len` predictions is truncated to its first `max_seq_len` (as Hydraulis and most
pre-training pipelines do, which keeps the length distribution's shape), or with `split=True` cut into
consecutive pieces so no text is dropped.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import json
import os
import sysconfig
import warnings

import numpy as np

from cfp.corpus import _expand
from cfp.errors import ConfigError

STDLIB = "stdlib"  # the --input value naming the built-in corpus
_TOP_LEVEL = (b"def ", b"class ", b"async def ", b"@")


class Unit(enum.Enum):
    DOCUMENT = "document"
    DEFINITION = "definition"
    DOCSTRING = "docstring"

    @classmethod
    def parse(cls, text: str) -> "Unit":
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(f"unit {text!r} is invalid; valid choices: "
                              f"{', '.join(u.value for u in cls)}") from None


def split_definitions(doc: bytes) -> list[bytes]:
    """Top-level definition blocks of Python source; a decorator line stays with the block it decorates."""
    blocks, cur, prev_decorator = [], [], False
    for line in doc.splitlines(keepends=True):
        starts = line.startswith(_TOP_LEVEL)
        if starts and cur and not prev_decorator:
            blocks.append(b"".join(cur))
            cur = []
        cur.append(line)
        prev_decorator = line.startswith(b"@") or (prev_decorator and not line.strip())
    if cur:
        blocks.append(b"".join(cur))
    return blocks


_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstrings(doc: bytes) -> list[bytes]:
    """The docstrings of Python source (module, classes, functions, in source order), cleaned of their
    indentation (`ast.get_docstring`); none for a file that does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)   # e.g. invalid escapes in old sources
            tree = ast.parse(doc)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES):
            text = ast.get_docstring(node)
            if text:
                out.append(text.encode("utf-8", errors="replace"))
    return out


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Byte sequences (uint8 arrays, each of length >= 2); `lengths` are their prediction counts (len - 1)."""
    tokens: tuple[np.ndarray, ...]
    source: str

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        return np.array([t.size - 1 for t in self.tokens], np.int64)

    def __len__(self) -> int:
        return len(self.tokens)


def _pieces(doc: bytes, max_seq_len: int | None, split: bool) -> list[np.ndarray]:
    arr = np.frombuffer(doc, np.uint8)
    if max_seq_len is None or arr.size <= max_seq_len + 1:
        return [arr] if arr.size >= 2 else []
    if not split:
        return [arr[:max_seq_len + 1]]
    # consecutive pieces share one boundary byte, so every byte pair is predicted exactly once
    out = [arr[i:i + max_seq_len + 1] for i in range(0, arr.size - 1, max_seq_len)]
    return [p for p in out if p.size >= 2]


def _jsonl_docs(path: str, key: str) -> list[bytes]:
    docs = []
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n} is not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get(key), str):
                raise ConfigError(f"{path}:{n} has no string field {key!r} (give --key with the text field)")
            docs.append(rec[key].encode("utf-8"))
    return docs


def load_sequences(path: str, key: str = "text", max_seq_len: int | None = None,
                   max_docs: int | None = None, unit: Unit | None = None, split: bool = False) -> Sequences:
    """Sequences of `path`: "stdlib", a .jsonl/.json file (field `key`), a text file or a folder of files.

    `unit` defaults to DEFINITION for "stdlib" and DOCUMENT otherwise."""
    unit = unit or (Unit.DEFINITION if path == STDLIB else Unit.DOCUMENT)
    if max_seq_len is not None and max_seq_len < 1:
        raise ConfigError(f"max_seq_len={max_seq_len!r} must be a positive integer")
    if path == STDLIB:
        # docstrings: the library's own (its test suites hold few, and parsing them would triple the time)
        skip = _TEST_DIRS if unit is Unit.DOCSTRING else frozenset()
        files = _expand([sysconfig.get_paths()["stdlib"]], (".py",), skip)
    elif os.path.isfile(path) and path.endswith((".jsonl", ".json")):
        files = None
    else:
        files = _expand([path], None)
    if files is None:
        docs = _jsonl_docs(path, key)
    else:
        docs = []
        for f in files[:max_docs] if max_docs else files:
            with open(f, "rb") as fh:
                docs.append(fh.read())
    if max_docs:
        docs = docs[:max_docs]
    if unit is Unit.DEFINITION:
        docs = [b for d in docs for b in split_definitions(d)]
    elif unit is Unit.DOCSTRING:
        docs = [b for d in docs for b in docstrings(d)]
    seqs = tuple(p for d in docs for p in _pieces(d, max_seq_len, split))
    if not seqs:
        raise ConfigError(f"input {path!r} holds no sequence of at least 2 bytes")
    return Sequences(seqs, path)
