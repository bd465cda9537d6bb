"""Batching methods (Hydraulis' numbering) as data, and turning a step's sequences into micro-batches.

  0 padding                       one mix; micro-batches of whole sequences padded to their longest
  1 fixed-length packing          one mix; sequences packed first-fit into max_len-token rows
  3 dispatch + fixed packing      heterogeneous mix; dispatch, then first-fit rows per pipeline
  4 dispatch + fine-grained       heterogeneous mix; dispatch, then cost-balanced micro-batches
Every micro-batch is laid out in rows (`cfp.data.rows`): padded, one sequence per row; packed, several per
row, rows as wide as the micro-batch's longest sequence (rounded up to a `WIDTHS` bucket), their count a
power of two; a micro-batch never computes more than its scheme's `max_len` token slots. So a pipeline
compiles at most `len(rows.row_shapes(max_len))` programs (16 at max_len 1024), and 0/1/3/4 all run the same
attention: they differ only in which sequences share a micro-batch and a row.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

import numpy as np

from cfp.data.dispatch import dispatch
from cfp.data.packing import MicroBatches, pack_balanced, pack_fixed, pack_fixed_rows
from cfp.data.rows import arrange, row_count, row_width
from cfp.data.schemes import CostForm, Scheme
from cfp.errors import ConfigError


class Packing(enum.Enum):
    PAD = "pad"
    FIXED = "fixed"
    BALANCED = "balanced"


@dataclasses.dataclass(frozen=True)
class Method:
    number: int
    name: str
    heterogeneous: bool      # dispatch to a heterogeneous mix (else a uniform one, sequences split evenly)
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


def _pad_batches(lengths: np.ndarray, max_len: int) -> MicroBatches:
    """Consecutive sequences, one per row, while the rows (a power of two) x the widest row <= max_len."""
    out: MicroBatches = []
    cur: list[int] = []
    widest = 0
    for i, s in enumerate(lengths.tolist()):
        w = row_width(s)
        if cur and row_count(len(cur) + 1) * max(widest, w) > max_len:
            out.append(cur)
            cur, widest = [], 0
        cur.append(i)
        widest = max(widest, w)
    if cur:
        out.append(cur)
    return out


def assign_step(method: Method, pipelines: Sequence[Scheme], lengths, ilp_max_sequences: int = 0
                ) -> list[MicroBatches]:
    """Per pipeline, its micro-batches as indices into `lengths` (every sequence exactly once)."""
    lengths = np.asarray(lengths, np.int64)
    if method.heterogeneous:
        owner = dispatch(pipelines, lengths, ilp_max_sequences)
        # each pipeline's sequences in data order, from one sort (a scan of the step per pipeline was O(n·P))
        ids = np.split(np.argsort(owner, kind="stable"), np.cumsum(np.bincount(owner, minlength=len(pipelines)))[:-1])
    else:
        ids = [np.arange(p, lengths.size, len(pipelines)) for p in range(len(pipelines))]
    out = []
    for p, scheme in enumerate(pipelines):
        local = lengths[ids[p]]
        if method.packing is Packing.PAD:
            mbs = _pad_batches(local, scheme.max_len)
        elif method.packing is Packing.FIXED:
            rows = scheme.form is CostForm.ROWS
            mbs = (pack_fixed_rows if rows else pack_fixed)(local, scheme.max_len)
        else:
            mbs = pack_balanced(local, scheme)
        glob = ids[p].tolist()    # plain ints: indexing a numpy array per element is several times slower
        out.append([[glob[i] for i in mb] for mb in mbs])
    return out


def materialize(tokens: Sequence[np.ndarray], mb: Sequence[int], packed: bool) -> dict[str, np.ndarray]:
    """Arrays [R,W] of one micro-batch arranged by `cfp.data.rows.arrange` (sequences in `mb`'s order):
    each sequence gets its own segment id (1..k) and positions restarting at 0; padding has segment 0,
    position 0 and weight 0."""
    seqs = [tokens[i] for i in mb]
    lay = arrange([s.size - 1 for s in seqs], packed)
    out = _empty(*lay.shape)
    for r, row in enumerate(lay.rows):
        at = 0
        for k in row:
            _fill(out, r, at, seqs[k], k + 1)
            at += seqs[k].size - 1
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
