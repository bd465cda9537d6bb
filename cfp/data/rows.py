"""How a micro-batch's sequences are arranged in rows [R, W] for the runtime (`arrange`).

Attention over a packed row (`cfp.models.packed_attention`) computes each row's diagonal blocks and the
off-diagonal blocks some sequence spans, so a row costs about its sequences' own causal blocks
(`layout_entries` counts exactly what it computes). Rows are as wide as the micro-batch's longest sequence (its
width bucket): the token slots of the layers outside attention are R·W.

* Widths are `WIDTHS` (128·2^(k/2): 128, 192, 256, 384, ...), finer than powers of two so rounding a row up
  wastes at most a third of it; a width is a multiple of 64, which the attention blocks need.
* Rows per micro-batch are rounded up to a power of two (the extra rows are padding), so the shapes [R, W] a
  micro-batch of at most `max_len` slots can take are few (`row_shapes`): each is compiled once.
* Sequences go into rows first-fit in the order given (`pack_rows`); a packer that wants a packing hands its
  sequences in that packing's row order and gets at most its rows back (first-fit never opens a row for a
  sequence that fits the rows before it, so row k's sequences land in rows <= k).

Every figure here (slots, padding, score entries) counts what the runtime computes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from cfp.errors import InfeasibleError
from cfp.models.attention import MIN_BLOCK, attention_block, causal_pairs
from cfp.models.packed_attention import kernel_entries

MIN_WIDTH = 128


def _widths(limit: int = 1 << 20) -> tuple[int, ...]:
    out, k = [], 0
    while True:
        w = MIN_WIDTH << (k // 2)
        w = w if k % 2 == 0 else w * 3 // 2
        if w > limit:
            return tuple(out)
        out.append(w)
        k += 1


WIDTHS = _widths()


def row_width(n: int) -> int:
    """The narrowest row width (`WIDTHS`) that holds `n` tokens."""
    for w in WIDTHS:
        if w >= n:
            return w
    raise InfeasibleError(f"a sequence of {n} tokens is longer than the widest row ({WIDTHS[-1]})")


def row_count(n: int) -> int:
    """Rows of a micro-batch holding `n` used rows: the next power of two."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@dataclasses.dataclass(frozen=True)
class MicroBatchRows:
    """A micro-batch as rows: `rows[r]` lists the sequences (indices into the micro-batch's list) of row r;
    `num_rows` >= len(rows) (the rest are padding)."""
    width: int
    rows: tuple[tuple[int, ...], ...]
    num_rows: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.width

    @property
    def slots(self) -> int:
        """Token positions computed (real + padding)."""
        return self.num_rows * self.width



def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit in the given order into rows of `width` tokens: indices into `lengths` per row."""
    return first_fit([(i, int(s)) for i, s in enumerate(lengths)], lambda s: width)


def first_fit(items: Sequence[tuple[int, int]], width_of) -> list[list[int]]:
    """``items`` (index, length) in the given order, each into the first row with room for it, else into a new
    row ``width_of(length)`` wide: the indices per row."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, s in items:
        for r, free in enumerate(room):
            if s <= free:
                rows[r].append(i)
                room[r] -= s
                break
        else:
            rows.append([i])
            room.append(width_of(s) - s)
    return rows


def arrange(lengths: Sequence[int], packed: bool) -> MicroBatchRows:
    """The rows of a micro-batch of sequences of `lengths` (in the order given): packed, several per row
    (`pack_rows`); not packed (padding), one sequence per row. The width is that of the longest."""
    lengths = [int(s) for s in lengths]
    if not lengths:
        raise InfeasibleError("a micro-batch needs at least one sequence")
    width = row_width(max(lengths))
    rows = pack_rows(lengths, width) if packed else [[i] for i in range(len(lengths))]
    return MicroBatchRows(width, tuple(tuple(r) for r in rows), row_count(len(rows)))


def layout_entries(lay: MicroBatchRows, lengths: Sequence[int], dense: bool = False) -> tuple[int, int]:
    """(attention score entries per head and layer the runtime computes on micro-batch `lay` of sequences of
    `lengths`, of which entries of padded queries or of unused tasks): packed causal attention's
    (`kernel_entries`), or with `dense` (ring attention of context-parallel stages) every pair of every row."""
    fills = [sum(int(lengths[k]) for k in row) for row in lay.rows]
    if dense:
        pad = sum(lay.width - f for f in fills) + (lay.num_rows - len(fills)) * lay.width
        return lay.num_rows * lay.width * lay.width, pad * lay.width
    rows = [[int(lengths[k]) for k in row] for row in lay.rows]
    return kernel_entries(rows, lay.num_rows, lay.width, attention_block(lay.width))


def seq_entries(s, dense: bool = False):
    """Estimated score entries of sequences of length s (array) alone: its own causal blocks, or (`dense`) a
    row of its width bucket's share s/W of W² (for the dispatch's per-sequence costs)."""
    s = np.asarray(s, np.float64)
    if dense:
        w = np.asarray(WIDTHS, np.float64)[np.searchsorted(WIDTHS, s)]
        return w * s
    nb = np.ceil(s / MIN_BLOCK)
    return nb * (nb + 1) / 2 * MIN_BLOCK * MIN_BLOCK


def own_pairs(lengths: Sequence[int]) -> int:
    """Score entries causal attention needs inside each sequence's own block: Σ s(s+1)/2."""
    return sum(int(s) * (int(s) + 1) // 2 for s in lengths)


def row_shapes(max_len: int) -> list[tuple[int, int]]:
    """Every [rows, width] a micro-batch of at most `max_len` slots can take."""
    return [(r, w) for w in WIDTHS if w <= max_len
            for r in (1 << k for k in range(int(math.log2(max_len // w)) + 1))]
