"""Stage one of the per-step assignment: dispatch a step's sequences to the pipelines of a mix.

A pipeline's estimated time is Σ seq_cost + (pp-1)·seq_cost(longest) (Hydraulis' estimate; packing refines
it). The greedy takes sequences longest first and gives each to the pipeline whose time grows least to the
smallest value (LPT on unrelated machines), among pipelines whose scheme fits the sequence; identical
pipelines of a scheme share one heap so a step costs O(n·K·log P). The HiGHS ILP minimising the slowest
pipeline is the exact reference; for small steps it starts from the greedy and runs under a time limit
(never worse than the greedy), unless the greedy already meets `lower_bound` and the ILP cannot pay.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from cfp.data.milp import Milp
from cfp.data.schemes import Scheme
from cfp.errors import InfeasibleError
from cfp.schedules.registry import pipeline_time


def pipeline_estimate(scheme: Scheme, lengths: np.ndarray) -> float:
    """Each sequence its own micro-batch through pp like stages (`cfp.schedules.registry.pipeline_time`)."""
    if lengths.size == 0:
        return 0.0
    return pipeline_time([1.0] * scheme.pp, scheme.seq_cost(lengths).tolist())


def shared_spans(works: Sequence[float], parallel: float | None) -> list[float]:
    """Each pipeline's span when they run side by side on devices that run only `parallel` pipelines at the
    speed of one alone (None: unlimited): processor sharing, every unfinished pipeline at min(1, parallel / k)
    of its own speed while k are unfinished. `works[p]` is pipeline p's time alone."""
    if parallel is None:
        return [float(w) for w in works]
    spans = [0.0] * len(works)
    t = done = 0.0
    order = sorted(range(len(works)), key=lambda p: works[p])
    for i, p in enumerate(order):
        rate = min(1.0, parallel / (len(works) - i))
        t += (works[p] - done) / rate
        done = works[p]
        spans[p] = t
    return spans


def makespan(pipelines: Sequence[Scheme], lengths, assign) -> float:
    lengths = np.asarray(lengths, np.int64)
    assign = np.asarray(assign)
    return max(pipeline_estimate(s, lengths[assign == p]) for p, s in enumerate(pipelines))


def _check_fit(pipelines: Sequence[Scheme], lengths: np.ndarray) -> None:
    longest = max(s.max_len for s in pipelines)
    if lengths.size and lengths.max() > longest:
        raise InfeasibleError(f"a sequence of {int(lengths.max())} tokens fits no pipeline (longest "
                              f"capacity {longest}); propose mixes for this max length")


def dispatch_greedy(pipelines: Sequence[Scheme], lengths) -> np.ndarray:
    """Pipeline index per sequence."""
    lengths = np.asarray(lengths, np.int64)
    _check_fit(pipelines, lengths)
    kinds = sorted(set(pipelines), key=lambda s: s.max_len)
    # a heap entry (load, pipeline, multiplier): a pipeline's first (= its longest) sequence also pays the
    # (pp-1) bubble, so its cost counts pp times until it has one (`pipeline_estimate`'s growth)
    heaps = [[(0.0, p, k.pp) for p, s in enumerate(pipelines) if s == k] for k in kinds]
    order = np.argsort(-lengths, kind="stable")
    ordered = lengths[order]
    # plain Python numbers in processing order: indexing numpy arrays per element is several times slower
    costs = [k.seq_cost(ordered).tolist() for k in kinds]
    first = np.searchsorted([k.max_len for k in kinds], ordered)   # the kinds that fit: first[i]..
    assign: list[int] = []
    # longest first, so the kinds that fit only grow: one run of sequences per first kind that fits
    for f in range(len(kinds) - 1, -1, -1):
        lo, hi = np.searchsorted(-first, [-f, -f + 1])
        if f == len(kinds) - 1:
            _one_kind(heaps[f], costs[f][lo:hi], assign)
        elif f == len(kinds) - 2:
            _two_kinds(heaps[f], heaps[f + 1], costs[f][lo:hi], costs[f + 1][lo:hi], assign)
        else:
            _least_of_kinds(heaps[f:], [c[lo:hi] for c in costs[f:]], assign)
    out = np.empty(lengths.size, np.int64)
    out[order] = assign
    return out


def _one_kind(heap: list[tuple], costs: list[float], assign: list[int]) -> None:
    """Each sequence (of `costs`) to the pipeline of the heap whose time grows to the least."""
    replace, put = heapq.heapreplace, assign.append
    for x in costs:
        load, p, mul = heap[0]
        replace(heap, (load + x * mul, p, 1))
        put(p)


def _two_kinds(h0: list[tuple], h1: list[tuple], c0: list[float], c1: list[float], assign: list[int]) -> None:
    """`_least_of_kinds` of two kinds (the usual mix's short sequences), unrolled."""
    replace, put = heapq.heapreplace, assign.append
    for x0, x1 in zip(c0, c1):
        l0, p0, m0 = h0[0]
        l1, p1, m1 = h1[0]
        t0, t1 = l0 + x0 * m0, l1 + x1 * m1
        if t1 < t0:
            replace(h1, (t1, p1, 1))
            put(p1)
        else:
            replace(h0, (t0, p0, 1))
            put(p0)


def _least_of_kinds(heaps: list[list], costs: list[list[float]], assign: list[int]) -> None:
    """Each sequence to the pipeline whose time grows to the least over the kinds (ties: the first kind)."""
    replace, put, inf = heapq.heapreplace, assign.append, float("inf")
    kinds = range(len(heaps))
    for i in range(len(costs[0])):
        best, best_k = inf, -1
        for k in kinds:
            load, _, mul = heaps[k][0]
            t = load + costs[k][i] * mul
            if t < best:
                best, best_k = t, k
        h = heaps[best_k]
        p = h[0][1]
        replace(h, (best, p, 1))
        put(p)


def dispatch_ilp(pipelines: Sequence[Scheme], lengths, time_limit: float = 1.0,
                 start: np.ndarray | None = None) -> tuple[np.ndarray | None, bool]:
    """HiGHS: minimise the slowest pipeline's estimate, from the assignment `start` if given.
    (assignment or None if none in time, proved optimal)."""
    lengths = np.asarray(lengths, np.int64)
    _check_fit(pipelines, lengths)
    n, q = lengths.size, len(pipelines)
    cost = np.stack([s.seq_cost(lengths) for s in pipelines], 1)      # [n, q]
    unit = max(float(cost.max()), 1e-30)
    cost = cost / unit
    p = Milp.new(n * q, q + 1)
    y0, z = n * q, n * q + q               # y_p: slowest sequence of p; z: slowest pipeline
    p.cost[z] = 1.0
    for i in range(n):
        ok = [j for j in range(q) if pipelines[j].max_len >= lengths[i]]
        p.add_row([i * q + j for j in ok], [1.0] * len(ok), 1.0, 1.0)
        for j in set(range(q)) - set(ok):
            p.upper[i * q + j] = 0.0
    for j, s in enumerate(pipelines):
        cols = [i * q + j for i in range(n)]
        for i in range(n):
            p.add_row([cols[i], y0 + j], [cost[i, j], -1.0], -np.inf, 0.0)
        p.add_row(cols + [y0 + j, z], cost[:, j].tolist() + [float(s.pp - 1), -1.0], -np.inf, 0.0)
    sol, optimal = p.solve(time_limit, None if start is None else _columns(pipelines, cost, start))
    if sol is None:
        return None, False
    return np.argmax(sol[:n * q].reshape(n, q), axis=1), optimal


def _columns(pipelines: Sequence[Scheme], cost: np.ndarray, assign: np.ndarray) -> np.ndarray:
    """The ILP's columns (x, y, z) of an assignment, costs in the ILP's units."""
    n, q = cost.shape
    x = np.zeros((n, q))
    x[np.arange(n), assign] = 1.0
    mine = x * cost
    y = mine.max(axis=0)
    z = (mine.sum(axis=0) + np.array([s.pp - 1 for s in pipelines]) * y).max()
    return np.concatenate([x.ravel(), y, [z]])


def lower_bound(pipelines: Sequence[Scheme], lengths) -> float:
    """No assignment's slowest pipeline is faster: each sequence pays at least pp x its cost on the cheapest
    pipeline that fits it (Σ cost + (pp-1)·max cost >= pp·cost)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size == 0:
        return 0.0
    each = np.stack([np.where(lengths <= s.max_len, s.pp * s.seq_cost(lengths), np.inf) for s in pipelines])
    return float(each.min(axis=0).max())


def dispatch(pipelines: Sequence[Scheme], lengths, ilp_max_sequences: int = 0,
             time_limit: float = 0.5) -> np.ndarray:
    """Greedy, improved by the ILP (started from the greedy, limited in time) when the step has at most
    `ilp_max_sequences` sequences and the greedy is not already provably optimal (at `lower_bound`)."""
    assign = dispatch_greedy(pipelines, lengths)
    if 0 < len(lengths) <= ilp_max_sequences:
        greedy = makespan(pipelines, lengths, assign)
        if greedy <= lower_bound(pipelines, lengths) * (1 + 1e-9):
            return assign
        exact, _ = dispatch_ilp(pipelines, lengths, time_limit, start=assign)
        if exact is not None and makespan(pipelines, lengths, exact) < greedy:
            return exact
    return assign
