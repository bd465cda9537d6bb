"""Stage two of the per-step assignment: pack one pipeline's sequences into micro-batches.

Fixed-length packing fills micro-batches of at most `max_len` tokens first-fit in data order (ROWS schemes:
at most `max_len` slots of their row layout). Fine-grained packing minimises the pipeline time
Σ_mb cost + (pp-1)·max_mb cost (the pipeline bubble is paid at the slowest micro-batch):
* VARLEN schemes: it balances micro-batch costs (longest-processing-time greedy under the token limit) and
  searches the micro-batch count m from ⌈tokens/max_len⌉ upward, keeping the best m. The HiGHS ILP minimising
  the slowest micro-batch for a given m is the exact reference.
* ROWS schemes (`pack_rows_balanced`): a micro-batch's cost is that of its rows, so it packs sequences into
  rows as narrow as they allow (first-fit decreasing, short sequences filling the gaps of wider rows), groups
  rows of one width into micro-batches and picks the micro-batch size with the least pipeline time.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from typing import Sequence

import numpy as np

from cfp.data.rows import arrange, first_fit, pack_rows, row_count, row_width
from cfp.data.schemes import CostForm, Scheme
from cfp.errors import InfeasibleError
from cfp.schedules.registry import pipeline_time as _schedule_time

MicroBatches = list[list[int]]   # per micro-batch, indices into the pipeline's length list
_tokens = operator.itemgetter(2)  # of a heap entry (cost, micro-batch, tokens, Σ s²)


def _check(lengths: np.ndarray, max_len: int) -> None:
    if lengths.size and lengths.max() > max_len:
        raise InfeasibleError(f"a sequence of {int(lengths.max())} tokens exceeds the micro-batch limit "
                              f"of {max_len} tokens")


def pack_fixed(lengths: Sequence[int], max_len: int) -> MicroBatches:
    """First-fit in data order into micro-batches of at most `max_len` tokens. The first micro-batch with room
    is found by bisection in the running maximum of the rooms (`best[j]` = most room among micro-batches
    0..j, non-decreasing), which a placement lowers only up to the next micro-batch with at least the room
    it had: O(n log m) for the usual steps, where scanning every micro-batch was O(n·m)."""
    lengths = np.asarray(lengths, np.int64)
    _check(lengths, max_len)
    bins: MicroBatches = []
    room: list[int] = []
    best: list[int] = []
    first = bisect.bisect_left
    for i, s in enumerate(lengths.tolist()):
        j = first(best, s)
        if j == len(best):
            bins.append([i])
            room.append(max_len - s)
            best.append(max(best[-1], max_len - s) if best else max_len - s)
            continue
        bins[j].append(i)
        room[j] -= s
        prev = best[j - 1] if j else -1      # the running maximum again, up to where it no longer changes
        for k in range(j, len(best)):
            v = room[k] if room[k] > prev else prev
            if v == best[k]:
                break
            best[k] = prev = v
    return bins


def pack_fixed_rows(lengths: Sequence[int], max_len: int) -> MicroBatches:
    """First-fit in data order into micro-batches whose row layout (each micro-batch's sequences longest
    first: first-fit decreasing rows) computes at most `max_len` token slots."""
    lengths = np.asarray(lengths, np.int64)
    _check(lengths, max_len)
    bins: MicroBatches = []
    held: list[list[int]] = []      # each bin's lengths, longest first
    for i, s in enumerate(lengths.tolist()):
        for j, mine in enumerate(held):
            if sum(mine) + s > max_len:
                continue
            trial = sorted(mine + [s], reverse=True)
            if arrange(trial, packed=True).slots <= max_len:
                held[j] = trial
                bins[j].append(i)
                break
        else:
            bins.append([i])
            held.append([s])
    return [sorted(mb, key=lambda i: -lengths[i]) for mb in bins]


def pipeline_time(scheme: Scheme, lengths: np.ndarray, mbs: MicroBatches, packed: bool = True) -> float:
    """Σ micro-batch cost + (pp-1)·slowest micro-batch: `cfp.schedules.registry.pipeline_time` of pp like stages
    (`packed`: False for padded micro-batches, one sequence per row)."""
    if not mbs:
        return 0.0
    return _schedule_time([1.0] * scheme.pp, [scheme.mb_cost(lengths[mb], packed) for mb in mbs])


def _sum_bound(total: float, sq: float, scheme: Scheme, m: int) -> float:
    """Least Σ micro-batch cost over m used micro-batches of `total` tokens (Σ s² = `sq`), varlen attention."""
    return scheme.a * sq + scheme.b * total + m * scheme.c


def min_count(lengths: np.ndarray, max_len: int) -> int:
    """Martello & Toth's L2 lower bound on the micro-batches of at most `max_len` tokens that can hold
    `lengths`: for each threshold k <= max_len/2, the sequences longer than max_len-k each need their own
    micro-batch, those in (max_len/2, max_len-k] too, and those in [k, max_len/2] must fit the room the latter
    leave or open new ones. Vectorised over every k that is a length (and k=0)."""
    s = np.sort(np.asarray(lengths, np.int64))
    if s.size == 0:
        return 0
    cum = np.concatenate([[0], np.cumsum(s)])
    h = int(np.searchsorted(s, max_len // 2, side="right"))      # s[:h]: at most half the limit
    ks = np.concatenate([[0], np.unique(s[:h])])
    over = np.searchsorted(s, max_len - ks, side="right")         # s[over:]: longer than max_len - k
    n2, sum2 = over - h, cum[over] - cum[h]                       # (max_len/2, max_len - k]
    sum3 = cum[h] - cum[np.searchsorted(s, ks, side="left")]      # [k, max_len/2]
    spill = np.maximum(0, -(-(sum3 - (n2 * max_len - sum2)) // max_len))
    return int(max((s.size - over + n2 + spill).max(), -(-int(cum[-1]) // max_len)))


def _lpt(lengths: np.ndarray, order: np.ndarray, scheme: Scheme, m: int, max_len: int,
         stop: float = np.inf, sums: tuple[float, float] | None = None,
         opening: tuple | None = None) -> tuple[MicroBatches, float] | None:
    """Each sequence (longest first) into the cheapest micro-batch with room, the lowest index among equals;
    with the pipeline time. None if a sequence does not fit, or once the pipeline time provably reaches `stop`
    (a count at least as good is known): m <= len(lengths) micro-batches all get used, so the time is at least
    `_sum_bound` plus (pp-1) x the slowest micro-batch so far, which only grows. `sums`: (Σ s, Σ s²) of
    `lengths` as floats, and `opening`: `_opening` of the lengths in `order` for at least m, if known."""
    a, b, c, bubble = scheme.a, scheme.b, scheme.c, scheme.pp - 1
    limit = np.inf
    if bubble and stop < np.inf and (a > 0 or b > 0):   # (every micro-batch used needs a > 0 or b > 0)
        if sums is None:
            lf = lengths.astype(np.float64)
            sums = float(lf.sum()), float((lf * lf).sum())
        limit = (stop - _sum_bound(sums[0], sums[1], scheme, m)) / bubble
    ordered = lengths[order]
    heap, k, slowest = _first_round(opening or _opening(ordered, scheme, m), scheme, m)
    if k and slowest >= limit:
        return None
    heapq.heapify(heap)
    parked: list[tuple] = []           # (tokens - max_len = -room, cost, micro-batch, tokens, Σ s²)
    got = _lpt_rest(ordered[k:].tolist(), heap, parked, scheme, max_len, slowest, limit)
    if got is None:
        return None
    owner, final = np.concatenate([np.arange(k), np.asarray(got, np.int64)]), heap + [e[1:] for e in parked]
    used = np.bincount(owner, minlength=m) > 0
    costs = [cost for cost, j, _, _ in sorted(final, key=lambda e: e[1]) if used[j]]
    return _bins(order, owner, m), _schedule_time([1.0] * scheme.pp, costs)


def _opening(ordered: np.ndarray, scheme: Scheme, m: int) -> tuple[list[tuple], list[float]]:
    """The greedy's first steps at once, for any count up to m: while every micro-batch holding a sequence
    costs more than an empty one (c), the i-th longest sequence opens micro-batch i. The heap entries (cost,
    micro-batch, tokens, Σ s²) of the micro-batches so opened (at most m), and the running maximum of their
    costs."""
    a, b, c = scheme.a, scheme.b, scheme.c
    s = ordered[:m]
    sq = s * s
    cost = a * sq + b * s + c          # the same float operations, in the same order, as `_lpt_rest`'s
    above = cost > c
    k = s.size if above.all() else int(np.argmin(above))
    entries = list(zip(cost[:k].tolist(), range(k), s[:k].tolist(), sq[:k].tolist()))
    return entries, np.maximum.accumulate(cost[:k]).tolist()


def _first_round(opening: tuple[list[tuple], list[float]], scheme: Scheme, m: int
                 ) -> tuple[list[tuple], int, float]:
    """The heap of m micro-batches after `_opening`'s steps (the rest empty), their number k, and the slowest
    micro-batch's cost."""
    entries, peak = opening
    k = min(len(entries), m)
    return entries[:k] + [(scheme.c, j, 0, 0) for j in range(k, m)], k, peak[k - 1] if k else scheme.c


def _lpt_rest(lens: list[int], heap: list[tuple], parked: list[tuple], scheme: Scheme, max_len: int,
              slowest: float, limit: float) -> list[int] | None:
    """The greedy from the state (`heap`, `parked`, updated in place) on: the micro-batch of each of `lens`;
    None as `_lpt`. Micro-batches without room for the current sequence wait in `parked` (most room first);
    sequences only get shorter, so each comes back once one fits: O(n log m), where setting them aside per
    sequence was O(n·m)."""
    a, b, c = scheme.a, scheme.b, scheme.c
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    out: list[int] = []
    put = out.append
    for s in lens:
        while parked and -parked[0][0] >= s:
            push(heap, pop(parked)[1:])
        top = heap[0]
        if top[2] + s > max_len:
            if len(heap) > 16 and min(heap, key=_tokens)[2] + s > max_len:
                return None        # no micro-batch has room: said at once, not after parking every one
            while top[2] + s > max_len:
                pop(heap)
                push(parked, (top[2] - max_len,) + top)
                if not heap:
                    return None
                top = heap[0]
        _, j, t, q = top
        t += s
        q += s * s
        cost = a * q + b * t + c
        replace(heap, (cost, j, t, q))
        put(j)
        if cost > slowest:
            slowest = cost
            if slowest >= limit:
                return None
    return out


def _bins(order: np.ndarray, owner: np.ndarray, m: int) -> MicroBatches:
    """The used micro-batches in index order, each its sequences (indices into the lengths) in `order`'s
    order; `owner[i]`: the micro-batch of the sequence `order[i]`."""
    flat = order[np.argsort(owner, kind="stable")].tolist()
    ends = np.cumsum(np.bincount(owner, minlength=m)).tolist()
    return [flat[lo:hi] for lo, hi in zip([0] + ends[:-1], ends) if hi > lo]


def pack_balanced(lengths: Sequence[int], scheme: Scheme, max_len: int | None = None,
                  extra: int = 20) -> MicroBatches:
    """Fine-grained packing: search m in [⌈tokens/max_len⌉, +extra] (offsets 0,1,2,4,8,16,extra, then
    halving the gaps around the best count) and keep the greedy packing with the least pipeline time.
    A count is skipped when no packing into it exists (`min_count`) or its lower bound cannot beat the best
    so far, and a greedy run stops as soon as it provably cannot: the bound is
    Σ cost + (pp-1)·max(mean micro-batch, longest sequence alone), and counts are tried most promising
    first. Only counts that cannot beat the best are dropped: the result is the unpruned search's (up to ties)."""
    lengths = np.asarray(lengths, np.int64)
    max_len = scheme.max_len if max_len is None else max_len
    _check(lengths, max_len)
    if lengths.size == 0:
        return []
    if scheme.form is CostForm.ROWS:
        return pack_rows_balanced(lengths, scheme, max_len)
    order = np.argsort(-lengths, kind="stable")
    lf = lengths.astype(np.float64)
    total, sq = float(lf.sum()), float((lf * lf).sum())
    alone = scheme.mb_cost(lengths[order[:1]])    # no micro-batch is cheaper than the longest sequence's
    m0 = -(-int(total) // max_len)
    top = min(m0 + extra, lengths.size)
    least = min_count(lengths, max_len)           # fewer micro-batches cannot hold the sequences at all
    opening = _opening(lengths[order], scheme, top)   # every count's first steps, computed once
    tried: dict[int, tuple] = {}
    bounds: dict[int, float] = {}

    def bound(m: int) -> float:
        if m not in bounds:
            bounds[m] = _count_bound(m)
        return bounds[m]

    def _count_bound(m: int) -> float:
        if m < least:
            return np.inf
        if scheme.a == 0 and scheme.b == 0:      # degenerate costs: micro-batches may stay empty, no bound
            return 0.0
        work = _sum_bound(total, sq, scheme, m)
        return work + (scheme.pp - 1) * max(work / m, alone)

    def attempt(ms) -> None:
        # most promising count first: a good early best lets the bound skip or stop the others
        for m in sorted({m for m in ms if m not in tried and m0 <= m <= top}, key=lambda m: (bound(m), m)):
            best = min((t for t, _ in tried.values()), default=np.inf)
            found = (None if bound(m) >= best
                     else _lpt(lengths, order, scheme, m, max_len, best, (total, sq), opening))
            tried[m] = (np.inf, None) if found is None else (found[1], found[0])

    # coarse offsets, then halve the gaps on both sides of the best count found so far
    attempt(m0 + d for d in (0, 1, 2, 4, 8, 16, extra))
    while True:
        cur = min(tried, key=lambda m: tried[m][0])
        lo = max((m for m in tried if m < cur), default=cur)
        hi = min((m for m in tried if m > cur), default=cur)
        todo = [m for m in ((lo + cur) // 2, (cur + hi) // 2) if m not in tried and m0 <= m <= top]
        if not todo:
            break
        attempt(todo)
    best_t, best = min(tried.values(), key=lambda v: v[0])
    if best is None:  # first-fit always succeeds when every sequence fits
        best = pack_fixed(lengths, max_len)
    return best



def _rows_decreasing(lengths: np.ndarray) -> list[list[int]]:
    """First-fit decreasing into rows, each as wide as its first (longest) sequence's `row_width`: a shorter
    sequence takes the first gap it fits (a row's attention costs the same however full it is) or opens a
    narrower row. Rows come widest first; indices into `lengths`."""
    order = np.argsort(-lengths, kind="stable").tolist()
    return first_fit([(i, int(lengths[i])) for i in order], row_width)


def _group_rows(rows: list[list[int]], widths: list[int], target: int) -> MicroBatches:
    """Consecutive rows (widest first) into micro-batches of at most target // width rows of the first row's
    width (a power of two); when a width runs out before that, the padding rows its power of two leaves are
    filled with the next rows, which then cost nothing more. Sequences in row order."""
    out: MicroBatches = []
    i = 0
    while i < len(rows):
        w = widths[i]
        cap = 1 << ((target // w).bit_length() - 1)       # the largest power of two <= target / w
        j = i
        while j < len(rows) and j - i < cap and widths[j] == w:
            j += 1
        j = min(len(rows), i + row_count(j - i))      # free fill of the padding rows
        out.append([k for r in rows[i:j] for k in r])
        i = j
    return out


def _merge_micro_batches(lengths: np.ndarray, scheme: Scheme, mbs: MicroBatches, limit: int) -> MicroBatches:
    """Merge pairs of micro-batches while a merge (the union laid out longest first) fits `limit` slots and
    lowers the pipeline time: a narrow micro-batch joining a wider one saves its per-micro-batch cost c and
    its padding rows for a little more attention. Best merge first, O(m²) costs per merge."""
    cost = [scheme.mb_cost(lengths[mb]) for mb in mbs]
    bubble = scheme.pp - 1
    while len(mbs) > 1:
        top = sorted(range(len(cost)), key=lambda k: -cost[k])[:3]
        now = sum(cost) + bubble * cost[top[0]]
        best, pick = 0.0, None
        for i, j in itertools.combinations(range(len(mbs)), 2):
            union = sorted(mbs[i] + mbs[j], key=lambda k: -lengths[k])
            ordered = lengths[union].tolist()
            lay = arrange(ordered, packed=True)
            if lay.slots > limit:
                continue
            c = scheme.layout_cost(lay, ordered)
            others = next((cost[k] for k in top if k not in (i, j)), 0.0)
            gain = now - (sum(cost) - cost[i] - cost[j] + c + bubble * max(c, others))
            if gain > best:
                best, pick = gain, (i, j, union, c)
        if pick is None:
            return mbs
        i, j, union, c = pick
        mbs = [mb for k, mb in enumerate(mbs) if k not in (i, j)] + [union]
        cost = [t for k, t in enumerate(cost) if k not in (i, j)] + [c]
    return mbs


def pack_rows_balanced(lengths: Sequence[int], scheme: Scheme, max_len: int | None = None) -> MicroBatches:
    """Fine-grained packing for ROWS schemes: rows by `_rows_decreasing`, grouped by `_group_rows` into
    micro-batches of at most `target` slots, then merged where that lowers the pipeline time
    (`_merge_micro_batches`), for each power-of-two target from `max_len` down to the widest row; the one
    with the least pipeline time (its layouts' costs) wins -- for pp = 1 usually the fewest micro-batches,
    deeper pipelines trade them for a smaller bubble."""
    lengths = np.asarray(lengths, np.int64)
    max_len = scheme.max_len if max_len is None else max_len
    _check(lengths, max_len)
    if lengths.size == 0:
        return []
    rows = _rows_decreasing(lengths)
    widths = [row_width(int(lengths[r[0]])) for r in rows]
    best, best_t = None, np.inf
    target = max_len
    while target >= widths[0]:
        mbs = _merge_micro_batches(lengths, scheme, _group_rows(rows, widths, target), target)
        t = pipeline_time(scheme, lengths, mbs)
        if t < best_t:
            best, best_t = mbs, t
        target //= 2
    return best
