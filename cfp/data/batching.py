"""Batching methods (Hydraulis' numbering) as data, and turning a step's sequences into micro-batches.

  0 padding                       one strategy; micro-batches of whole sequences padded to their longest
  1 fixed-length packing          one strategy; sequences packed first-fit into max_len-token rows
  3 dispatch + fixed packing      heterogeneous strategy; dispatch, then first-fit rows per pipeline
  4 dispatch + fine-grained       heterogeneous strategy; dispatch, then cost-balanced micro-batches
Rows are padded to `bucket_len` (a power of two, at least 128) and a padded micro-batch always has
max_len / bucket rows (rows beyond its sequences are all padding), so a pipeline shape compiles at most
log2(max_len/128)+1 programs (5 at max_len 2048): CPU compiles take seconds each.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

import numpy as np

from cfp.data.dispatch import dispatch
from cfp.data.packing import MicroBatches, pack_balanced, pack_fixed
from cfp.data.schemes import Scheme
from cfp.errors import ConfigError

MIN_BUCKET = 128


class Packing(enum.Enum):
    PAD = "pad"
    FIXED = "fixed"
    BALANCED = "balanced"


@dataclasses.dataclass(frozen=True)
class Method:
    number: int
    name: str
    heterogeneous: bool      # dispatch to a heterogeneous strategy (else a uniform one, sequences split evenly)
    packing: Packing


METHODS = {m.number: m for m in (
    Method(0, "padding", False, Packing.PAD),
    Method(1, "fixed-length packing", False, Packing.FIXED),
    Method(3, "dispatch + fixed-length packing", True, Packing.FIXED),
    Method(4, "dispatch + fine-grained packing", True, Packing.BALANCED),
)}


def get_method(number: int) -> Method:
    if number not in METHODS:
        raise ConfigError(f"batching method {number!r} is unknown; valid choices: "
                          + ", ".join(f"{k} ({m.name})" for k, m in METHODS.items()))
    return METHODS[number]


def bucket_len(n: int) -> int:
    return max(MIN_BUCKET, 1 << int(np.ceil(np.log2(max(n, 1)))))


def _pad_batches(lengths: np.ndarray, max_len: int) -> MicroBatches:
    """Consecutive sequences while rows x padded longest <= max_len tokens."""
    out: MicroBatches = []
    cur: list[int] = []
    for i, s in enumerate(lengths.tolist()):
        longest = max([s] + [int(lengths[j]) for j in cur])
        if cur and (len(cur) + 1) * bucket_len(longest) > max_len:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def assign_step(method: Method, pipelines: Sequence[Scheme], lengths, ilp_max_sequences: int = 0
                ) -> list[MicroBatches]:
    """Per pipeline, its micro-batches as indices into `lengths` (every sequence exactly once)."""
    lengths = np.asarray(lengths, np.int64)
    if method.heterogeneous:
        owner = dispatch(pipelines, lengths, ilp_max_sequences)
        ids = [np.flatnonzero(owner == p) for p in range(len(pipelines))]
    else:
        ids = [np.arange(p, lengths.size, len(pipelines)) for p in range(len(pipelines))]
    out = []
    for p, scheme in enumerate(pipelines):
        local = lengths[ids[p]]
        if method.packing is Packing.PAD:
            mbs = _pad_batches(local, scheme.max_len)
        elif method.packing is Packing.FIXED:
            mbs = pack_fixed(local, scheme.max_len)
        else:
            mbs = pack_balanced(local, scheme)
        glob = ids[p].tolist()    # plain ints: indexing a numpy array per element is several times slower
        out.append([[glob[i] for i in mb] for mb in mbs])
    return out


def materialize(tokens: Sequence[np.ndarray], mb: Sequence[int], packed: bool, max_len: int = 0
                ) -> dict[str, np.ndarray]:
    """Arrays [R,S] of one micro-batch: packed -> one row of concatenated sequences (segment ids 1..k,
    positions restarting at 0); padded -> one row per sequence, max(1, max_len // S) rows.
    Padding has segment 0 and weight 0."""
    seqs = [tokens[i] for i in mb]
    if packed:
        n = sum(s.size - 1 for s in seqs)
        width = bucket_len(n)
        out = _empty(1, width)
        at = 0
        for k, s in enumerate(seqs, 1):
            _fill(out, 0, at, s, k)
            at += s.size - 1
        return out
    width = bucket_len(max(s.size - 1 for s in seqs))
    out = _empty(max(len(seqs), max_len // width), width)
    for r, s in enumerate(seqs):
        _fill(out, r, 0, s, 1)
    return out


def _empty(rows: int, width: int) -> dict[str, np.ndarray]:
    return {"inputs": np.zeros((rows, width), np.int32), "targets": np.zeros((rows, width), np.int32),
            "weights": np.zeros((rows, width), np.float32), "segment_ids": np.zeros((rows, width), np.int32),
            "positions": np.zeros((rows, width), np.int32)}


def _fill(out: dict, row: int, at: int, seq: np.ndarray, segment: int) -> None:
    n = seq.size - 1
    sl = slice(at, at + n)
    out["inputs"][row, sl] = seq[:-1]
    out["targets"][row, sl] = seq[1:]
    out["weights"][row, sl] = 1.0
    out["segment_ids"][row, sl] = segment
    out["positions"][row, sl] = np.arange(n)
