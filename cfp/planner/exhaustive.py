"""The exhaustive optimum over the planner's layout space, for small clusters (<= 16 devices).

Space: every TP degree per device type; every grouping of the resulting TP groups into pipelines
(groups of one machine are interchangeable, so groupings are multiset partitions); every order of
each pipeline's machines (a machine's stages kept together); every split of the layers over stages
that fits memory; every micro-batch size and every split of the micro-batches over pipelines. The
last is solved exactly rather than enumerated: the step is the slowest pipeline plus terms that do not
depend on micro-batch counts, and each pipeline's time is increasing in its count, so
`allocate_chunks` (min-max water-filling) is optimal.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, Optional, Sequence

from cfp.errors import InfeasibleError
from cfp.planner.build import allocate_chunks, max_chunks, pipeline_terms
from cfp.planner.costmodel import ClusterLayout, CostModel, Estimate, PipelineLayout, StageLayout
from cfp.planner.options import PlannerOptions
from cfp.planner.partition import machine_groups
from cfp.planner.planner import tp_choices

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


def _pipeline_orders(blocks: list[list[StageLayout]]) -> Iterator[tuple[StageLayout, ...]]:
    for perm in itertools.permutations(range(len(blocks))):
        yield tuple(s for i in perm for s in blocks[i])


def _layer_splits(cm: CostModel, stages: tuple[StageLayout, ...], batch: int, chunks: int, k: int):
    L = cm.config.num_layers
    for comp in compositions(L, len(stages), [L] * len(stages)):
        st = tuple(StageLayout(s.devices, s.machine, n) for s, n in zip(stages, comp))
        pipe = PipelineLayout(st, batch, chunks)
        if all(cm.stage_memory(s, i, pipe, k) <= cm.cluster.machines[s.machine].memory
               for i, s in enumerate(st)):
            yield pipe


def exhaustive_layout(cm: CostModel, options: PlannerOptions, limit: int = 200_000
                      ) -> tuple[ClusterLayout, Estimate, int]:
    """(best layout, its estimate, layouts estimated); InfeasibleError past `limit` or > 16 devices."""
    cl = cm.cluster
    if cl.num_devices > MAX_DEVICES:
        raise InfeasibleError(f"exhaustive search covers at most {MAX_DEVICES} devices, the cluster has "
                              f"{cl.num_devices}")
    choices = tp_choices(cl, cm.config.num_heads)
    names = sorted(choices)
    best, count = None, 0
    for combo in itertools.product(*(choices[g] for g in names)):
        tp = dict(zip(names, combo))
        groups = machine_groups(cl, range(cl.num_devices), lambda m: tp[cl.machines[m].gpu.name],
                                cm.config.num_heads)
        kinds = sorted({(cl.devices[g[0]].machine, len(g)) for g in groups})
        pool = {kd: [g for g in groups if (cl.devices[g[0]].machine, len(g)) == kd] for kd in kinds}
        counts = tuple(len(pool[kd]) for kd in kinds)
        for blocks in multiset_partitions(counts):
            k = len(blocks)
            taken = {kd: 0 for kd in kinds}
            pipes_blocks = []
            for b in blocks:
                mblocks: dict[int, list[StageLayout]] = {}
                for kd, n in zip(kinds, b):
                    for g in pool[kd][taken[kd]:taken[kd] + n]:
                        mblocks.setdefault(kd[0], []).append(StageLayout(tuple(g), kd[0], 0))
                    taken[kd] += n
                pipes_blocks.append([mblocks[m] for m in sorted(mblocks)])
            for mb in options.micro_batch_sizes:
                G = options.global_batch_size
                if G % mb or G // mb < k:
                    continue
                total = G // mb
                per_pipe = [[p.stages for order in _pipeline_orders(pb)
                             for p in _layer_splits(cm, order, mb, 1, k)] for pb in pipes_blocks]
                for combo in itertools.product(*per_pipe):
                    count += 1
                    if count > limit:
                        raise InfeasibleError(f"exhaustive search passed {limit} layouts; use a "
                                              f"smaller cluster or fewer layers")
                    chunks = allocate_chunks([pipeline_terms(cm, st, mb) for st in combo],
                                             [max_chunks(cm, st, mb, k, total) for st in combo], total)
                    if chunks is None:
                        continue
                    lay = ClusterLayout(tuple(PipelineLayout(st, c * mb, c) for st, c in zip(combo, chunks)))
                    e = cm.estimate(lay)
                    if e.fits and (best is None or e.objective < best[1].objective):
                        best = (lay, e)
    if best is None:
        raise InfeasibleError("no layout fits the cluster's memory")
    return best[0], best[1], count
