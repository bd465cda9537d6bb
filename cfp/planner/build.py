"""From device groups to an estimated layout: layers split by stage speed under memory limits, the
global batch split by pipeline throughput into micro-batches."""
from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence

from cfp.hardware.collectives import collective_time
from cfp.layout import Layout, Pipeline, Stage
from cfp.planner.costmodel import CostModel, Places
from cfp.planner.step_features import Among

_MISSING = object()


def stage_layouts(cm: CostModel, groups: Sequence[Sequence[int]]) -> list[Stage]:
    devs = cm.cluster.devices
    return [Stage(tuple(g), 0, devs[g[0]].machine) for g in groups]


def layer_time(cm: CostModel, st: Stage, mb: int) -> float:
    """Seconds one layer adds to a stage's forward + backward of one micro-batch (memoised by machine spec)."""
    key = ("layer_time", cm.kind[st.machine], len(st.devices), mb)
    t = cm.build_memo.get(key)
    if t is None:
        m = cm.model
        intra = cm.cluster.machines[st.machine].intra_bandwidth
        ar = collective_time("all-reduce", mb * m.boundary_bytes(), st.tp, intra)
        t = cm.build_memo[key] = 4 * cm.layer_seconds(st.machine, st.tp, mb) + 3 * m.layer_all_reduces(st.tp) * ar
    return t


def split_layers(cm: CostModel, stages: Sequence[Stage], batch: int, chunks: int,
                 n_pipes: Places) -> Optional[tuple[Stage, ...]]:
    """Layers per stage minimising the slowest stage (the head's time counted on the last; adding layers
    one at a time where the stage stays fastest is exact for this min-max) subject to each stage's
    memory; None when the model does not fit."""
    counts = layer_counts(cm, stages, batch, chunks, n_pipes, order_token(cm, stages))
    return None if counts is None else tuple(Stage(s.devices, k, s.machine) for s, k in zip(stages, counts))


def layer_counts(cm: CostModel, stages: Sequence[Stage], batch: int, chunks: int, n_pipes: Places,
                 token: int) -> Optional[tuple[int, ...]]:
    """`split_layers`' layer counts, memoised on all they depend on: the order (`token`, its `order_token`: the
    stages' layers now do not matter), the micro-batch, the place and what the base schedule keeps at each
    stage (`CostModel.placed`: the micro-batch count matters only through it)."""
    key = ("layer_counts", token, batch // chunks, n_pipes, cm.placed(len(stages), chunks))
    counts = cm.build_memo.get(key, _MISSING)
    if counts is _MISSING:
        counts = cm.build_memo[key] = _layer_counts(cm, stages, batch, chunks, n_pipes)
    return counts


def _layer_counts(cm: CostModel, stages: Sequence[Stage], batch: int, chunks: int,
                  n_pipes: Places) -> Optional[tuple[int, ...]]:
    L = cm.model.num_layers
    if len(stages) > L:
        return None
    mb = batch // chunks
    caps = []
    for c in cm.layer_capacities(Pipeline(tuple(stages), batch, chunks), n_pipes):
        caps.append(max(0, min(L, c)))
        if caps[-1] < 1:        # (mostly the first stage, under the embedding and the stored inputs)
            return None
    if sum(caps) < L:
        return None
    tau = [layer_time(cm, st, mb) for st in stages]
    last = stages[-1]
    # a stage's steady-state slot also holds its send and the previous stage's (not overlapped with
    # compute in the schedule's estimate): a stage behind a slow link gets fewer layers
    sent, link = mb * cm.model.boundary_bytes(), cm.cluster.link
    sends = [sent / link(a.machine, b.machine) for a, b in zip(stages, stages[1:])] + [0.0]
    fixed = [sends[i] + (sends[i - 1] if i else 0.0) for i in range(len(stages))]
    fixed[-1] += 4 * cm.head_seconds(last.machine, last.tp, mb)
    n = [1] * len(stages)
    heap = [(fixed[i] + 2 * tau[i], i) for i in range(len(stages)) if caps[i] > 1]
    heapq.heapify(heap)
    for _ in range(L - len(stages)):
        i = heap[0][1]
        n[i] += 1
        if n[i] < caps[i]:
            heapq.heapreplace(heap, (fixed[i] + (n[i] + 1) * tau[i], i))
        else:
            heapq.heappop(heap)
    return tuple(n)


def pipeline_terms(cm: CostModel, stages: Sequence[Stage], micro_batch: int) -> tuple[float, float]:
    """(A, W) with the pipeline's time at c micro-batches A + (c - 1) * W (stage times depend on the
    micro-batch size only)."""
    ests = cm.stage_estimates(Pipeline(tuple(stages), micro_batch, 1), 1)
    a = cm.pipeline_time(ests, 1)
    return a, cm.pipeline_time(ests, 2) - a


def max_chunks(cm: CostModel, stages: Sequence[Stage], micro_batch: int, n_pipes: Places, limit: int) -> int:
    """Most micro-batches (<= limit) the pipeline holds within memory under the cost model's base schedule:
    only what the stages keep between forward and backward grows with them (without bound under GPipe, up to a
    schedule's most in flight otherwise) and never falls, so the largest count whose every stage fits is found
    by bisection; 0 when one micro-batch does not fit. Memoised on the stages' shape (machine spec, TP degree,
    layers: all the memory depends on)."""
    key = ("max_chunks", tuple((cm.kind[st.machine], len(st.devices), st.layers) for st in stages), micro_batch,
           n_pipes, limit)
    hit = cm.build_memo.get(key)
    if hit is None:
        hit = cm.build_memo[key] = _max_chunks(cm, stages, micro_batch, n_pipes, limit)
    return hit


def _max_chunks(cm: CostModel, stages: Sequence[Stage], micro_batch: int, n_pipes: Places, limit: int) -> int:
    caps = [cm.cluster.machines[st.machine].memory for st in stages]

    def fits(c: int) -> bool:
        pipe = Pipeline(tuple(stages), c * micro_batch, c)
        return all(cm.stage_memory(st, i, pipe, n_pipes) <= cap for i, (st, cap) in enumerate(zip(stages, caps)))

    if limit < 1 or not fits(1):
        return 0
    lo, hi = 1, limit
    if fits(hi):
        return hi
    while hi - lo > 1:          # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def allocate_chunks(terms: Sequence[tuple[float, float]], caps: Sequence[int], total: int) -> Optional[list[int]]:
    """Micro-batches per pipeline minimising the slowest pipeline, A_p + (c_p - 1) * W_p, with
    1 <= c_p <= caps[p]; adding one at a time to the pipeline that stays fastest is optimal for a
    min-max of increasing functions. None when the caps cannot hold `total`."""
    k = len(terms)
    if total < k or sum(caps) < total or min(caps) < 1:
        return None
    c = [1] * k
    heap = [(a + w, p) for p, (a, w) in enumerate(terms) if caps[p] > 1]
    heapq.heapify(heap)
    pop, replace = heapq.heappop, heapq.heapreplace
    for _ in range(total - k):      # (thousands of micro-batches at scale: the pop and push as one replace)
        p = heap[0][1]
        c[p] += 1
        if c[p] < caps[p]:
            a, w = terms[p]
            replace(heap, (a + c[p] * w, p))
        else:
            pop(heap)
    return c


def orders_signature(cm: CostModel, orders: Sequence[Sequence[Stage]]) -> tuple[int, ...]:
    """What the layer splits and times of a pipeline's candidate stage orders depend on, one token per order
    (`order_token`); pipelines of like machines share it."""
    return tuple(order_token(cm, o) for o in orders)


def order_token(cm: CostModel, order: Sequence[Stage]) -> int:
    """A small int standing for what the layer split and times of a stage order depend on: per stage its
    machine's spec and TP degree, and whether its neighbour is on the same machine (the link). Interned, so the
    memo keys of the search hash one int where they hashed the order's ~30 entries (planning 1024 GPUs builds
    ~17,000 keys of orders)."""
    kind = cm.kind
    sig = (tuple((kind[st.machine], len(st.devices)) for st in order),
           tuple(a.machine == b.machine for a, b in zip(order, order[1:])))
    tokens = cm.build_memo.setdefault("order tokens", {})
    return tokens.setdefault(sig, len(tokens))


def best_order(cm: CostModel, orders: Sequence[Sequence[Stage]], chunks: int, micro_batch: int,
                n_pipes: Places, signature: Optional[tuple] = None) -> Optional[tuple[Stage, ...]]:
    """The candidate stage order, with its layers split for `chunks` micro-batches, whose pipeline (and
    optimizer update) is fastest; None when no order fits. Memoised by the orders' signature
    (`orders_signature`): planning at scale builds many pipelines of like machines."""
    sig = orders_signature(cm, orders) if signature is None else signature
    key = ("best_order", sig, chunks, micro_batch, n_pipes)
    memo = cm.build_memo
    if key not in memo:
        # orders relabelled from a pipeline of like machines (the planner's `_Relabelled`) are searched as the
        # orders they map: the search depends on their signature alone, and mapping every order costs more
        memo[key] = _search_orders(cm, getattr(orders, "source", orders), chunks, micro_batch, n_pipes, sig)
    hit = memo[key]
    if hit is None:
        return None
    # the stages built for these very orders before (kept with them, so their id is not reused meanwhile)
    built = memo.setdefault("built", {})
    got = built.get((key, id(orders)))
    if got is None or got[0] is not orders:
        got = built[key, id(orders)] = (orders, tuple(Stage(st.devices, n, st.machine)
                                                      for st, n in zip(orders[hit[0]], hit[1])))
    return got[1]


def _search_orders(cm: CostModel, orders: Sequence[Sequence[Stage]], chunks: int, micro_batch: int,
                   n_pipes: Places, sig: tuple[int, ...]) -> Optional[tuple[int, tuple[int, ...]]]:
    best, best_t = None, math.inf
    for i, stages in enumerate(orders):
        counts = layer_counts(cm, stages, chunks * micro_batch, chunks, n_pipes, sig[i])
        if counts is not None:
            st = tuple(Stage(s.devices, n, s.machine) for s, n in zip(stages, counts))
            a, w = pipeline_terms(cm, st, micro_batch)
            # the update depends on the stages alone: priced on `pipeline_terms`' probe, whose stage figures
            # are memoised by now
            probe = cm.stage_estimates(Pipeline(st, micro_batch, 1), 1)
            t = a + (chunks - 1) * w + cm.stages_update_time(st, probe)
            if t < best_t:
                best, best_t = (i, counts), t
    return best


def build_layout(cm: CostModel, pipes: Sequence[Sequence[Sequence[Stage]]], global_batch: int,
                 micro_batch: int, signatures: Optional[Sequence[tuple]] = None) -> Optional[Layout]:
    """`pipes`: per pipeline, candidate stage orders (`signatures`: their `orders_signature`s, if known).
    Each pipeline's order and layer split chosen at an even share of micro-batches (memory checked there),
    micro-batches split by pipeline time under memory, then each order re-chosen with its layers re-split for
    the real micro-batch count (the best order depends on it: the first stage stores more inputs, the last
    holds the head)."""
    k = len(pipes)
    if global_batch % micro_batch or global_batch // micro_batch < k:
        return None
    total = global_batch // micro_batch
    guess = max(1, total // k)
    sigs = signatures or [orders_signature(cm, orders) for orders in pipes]
    places = [Among(k, p == 0) for p in range(k)]    # pipeline 0 holds the optimizer state (`Among`)
    first = [best_order(cm, orders, guess, micro_batch, at, sig) for orders, sig, at in zip(pipes, sigs, places)]
    if any(st is None for st in first):
        return None
    chunks = allocate_chunks([pipeline_terms(cm, st, micro_batch) for st in first],
                             [max_chunks(cm, st, micro_batch, at, total) for st, at in zip(first, places)], total)
    if chunks is None:
        return None
    out = []
    for orders, sig, c, at in zip(pipes, sigs, chunks, places):
        st = best_order(cm, orders, c, micro_batch, at, sig)
        if st is None:
            return None
        out.append(Pipeline(st, c * micro_batch, c))
    return Layout.unchecked(tuple(out))
