"""The exhaustive optimum over the planner's layout space, for small clusters (<= 16 devices).

Space: every cut of each machine's devices into TP groups of power-of-two sizes that divide the heads
(mixed sizes included, as the planner's remainders and refinement produce them); every grouping of
those groups into pipelines (groups of one machine and size are interchangeable, so groupings are
multiset partitions); every order of each pipeline's machines (a machine's stages kept together) and
of the group sizes inside each machine; every split of the layers over stages
that fits memory; every micro-batch size and every split of the micro-batches over pipelines. The
last is solved exactly rather than enumerated: the step is the slowest pipeline plus terms that do not
depend on micro-batch counts, and each pipeline's time is increasing in its count, so
`allocate_chunks` (min-max water-filling) is optimal.
"""
from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence

from cfp.errors import InfeasibleError
from cfp.layout import Layout, Pipeline, Stage
from cfp.planner.build import allocate_chunks, max_chunks, pipeline_terms
from cfp.planner.costmodel import CostModel, Estimate
from cfp.planner.metis import size_cuts, size_orders
from cfp.planner.options import PlannerOptions
from cfp.planner.step_features import Among

MAX_DEVICES = 16


def _sub_vectors(counts: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    for v in itertools.product(*(range(c, -1, -1) for c in counts)):
        if any(v):
            yield v


def multiset_partitions(counts: tuple[int, ...], cap: Optional[tuple[int, ...]] = None):
    """Partitions of a multiset (given as counts per kind) into unordered non-empty blocks."""
    if not any(counts):
        yield []
        return
    for b in _sub_vectors(counts):
        if cap is not None and b > cap:
            continue
        for rest in multiset_partitions(tuple(c - x for c, x in zip(counts, b)), b):
            yield [b] + rest


def compositions(total: int, parts: int, caps: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Ways to write `total` as `parts` positive integers, part i at most caps[i]."""
    if parts == 1:
        if 1 <= total <= caps[0]:
            yield (total,)
        return
    for first in range(1, min(caps[0], total - parts + 1) + 1):
        for rest in compositions(total - first, parts - 1, caps[1:]):
            yield (first,) + rest


def _distinct_orders(block: list[Stage]) -> list[tuple[Stage, ...]]:
    """Orders of one machine's groups that differ in the sequence of sizes (same-size groups of a machine
    are interchangeable)."""
    by_size: dict[int, list[Stage]] = {}
    for s in block:
        by_size.setdefault(s.tp, []).append(s)
    out = []
    for seq in size_orders([s.tp for s in block]):
        used = {t: 0 for t in by_size}
        order = []
        for t in seq:
            order.append(by_size[t][used[t]])
            used[t] += 1
        out.append(tuple(order))
    return out


def _pipeline_orders(blocks: list[list[Stage]]) -> Iterator[tuple[Stage, ...]]:
    inner = [_distinct_orders(b) for b in blocks]
    for perm in itertools.permutations(range(len(blocks))):
        for parts in itertools.product(*(inner[i] for i in perm)):
            yield tuple(s for part in parts for s in part)


def _machine_groups(cl, cuts: Sequence[tuple[int, ...]]) -> list[list[int]]:
    out, first = [], 0
    for m, cut in zip(cl.machines, cuts):
        for t in cut:
            out.append(list(range(first, first + t)))
            first += t
    return out


def _layer_splits(cm: CostModel, stages: tuple[Stage, ...], batch: int, chunks: int, k: "int | Among"):
    L = cm.model.num_layers
    for comp in compositions(L, len(stages), [L] * len(stages)):
        st = tuple(Stage(s.devices, n, s.machine) for s, n in zip(stages, comp))
        pipe = Pipeline(st, batch, chunks)
        if all(cm.stage_memory(s, i, pipe, k) <= cm.cluster.machines[s.machine].memory
               for i, s in enumerate(st)):
            yield pipe


def _placed_options(cm: CostModel, blocks: list, pipes_blocks: list, mb: int, total: int, memo: dict
                    ) -> Iterator[list[list]]:
    """Per choice of the block that is pipeline 0 (which alone holds the optimizer state, `Among`; one per
    distinct block), per pipeline in layout order its (stages, time terms, micro-batch cap) of every order and
    layer split that fits at its place (`memo`: by block and place)."""
    k = len(blocks)
    owners = [j for j, b in enumerate(blocks) if b not in blocks[:j]]
    for o in owners:
        order = [o] + [j for j in range(k) if j != o]
        per_pipe = []
        for p, j in enumerate(order):
            at = Among(k, p == 0)
            if (j, at) not in memo:
                memo[j, at] = [(q.stages, pipeline_terms(cm, q.stages, mb), max_chunks(cm, q.stages, mb, at, total))
                               for od in _pipeline_orders(pipes_blocks[j]) for q in _layer_splits(cm, od, mb, 1, at)]
            per_pipe.append(memo[j, at])
        yield per_pipe


def exhaustive_layout(cm: CostModel, options: PlannerOptions, limit: int = 200_000
                      ) -> tuple[Layout, Estimate, int]:
    """(best layout, its estimate, layouts estimated); InfeasibleError past `limit` or > 16 devices."""
    cl = cm.cluster
    if cl.num_devices > MAX_DEVICES:
        raise InfeasibleError(f"exhaustive search covers at most {MAX_DEVICES} devices, the cluster has "
                              f"{cl.num_devices}")
    best, count = None, 0
    for cuts in itertools.product(*(size_cuts(m.count, cm.model.tp_divisor) for m in cl.machines)):
        groups = _machine_groups(cl, cuts)
        kinds = sorted({(cl.devices[g[0]].machine, len(g)) for g in groups})
        pool = {kd: [g for g in groups if (cl.devices[g[0]].machine, len(g)) == kd] for kd in kinds}
        counts = tuple(len(pool[kd]) for kd in kinds)
        for blocks in multiset_partitions(counts):
            k = len(blocks)
            taken = {kd: 0 for kd in kinds}
            pipes_blocks = []
            for b in blocks:
                mblocks: dict[int, list[Stage]] = {}
                for kd, n in zip(kinds, b):
                    for g in pool[kd][taken[kd]:taken[kd] + n]:
                        mblocks.setdefault(kd[0], []).append(Stage(tuple(g), 0, kd[0]))
                    taken[kd] += n
                pipes_blocks.append([mblocks[m] for m in sorted(mblocks)])
            for mb in options.micro_batch_sizes:
                G = options.global_batch_size
                if G % mb or G // mb < k:
                    continue
                total = G // mb
                placed = _placed_options(cm, blocks, pipes_blocks, mb, total, {})
                for combo in itertools.chain.from_iterable(itertools.product(*pp) for pp in placed):
                    count += 1
                    if count > limit:
                        raise InfeasibleError(f"exhaustive search passed {limit} layouts; use a "
                                              f"smaller cluster or fewer layers")
                    chunks = allocate_chunks([c[1] for c in combo], [c[2] for c in combo], total)
                    if chunks is None:
                        continue
                    lay = Layout.unchecked(tuple(Pipeline(st, c * mb, c) for (st, _, _), c in zip(combo, chunks)))
                    e = cm.estimate(lay)
                    if e.fits and (best is None or e.objective < best[1].objective):
                        best = (lay, e)
    if best is None:
        raise InfeasibleError("no layout fits the cluster's memory")
    return best[0].checked(), best[1], count
