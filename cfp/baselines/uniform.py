"""Whole-model reference plans that join the search's measured verification (CFP verifies "a few uniform
plans" next to the DP's best): data parallel, and on a 2-D mesh data parallel on axis 0 with a
communication-greedy tensor-parallel choice on axis 1 (which recovers Megatron's column/row alternation)."""
from __future__ import annotations

from cfp.analysis.analysis import Analysis
from cfp.analysis.blocks import data_parallel_choice, loops_of
from cfp.analysis.block_sharding import shards
from cfp.analysis.strategies import LoopKind


def dp_tp_choice(analysis: Analysis) -> tuple[int, ...] | None:
    """Axis 0 shards each block's batch-like loop; axis 1 shards a loop of the block's rhs, taking, block by
    block in program order, the strategy with the fewest predicted collective bytes plus bytes resharded from
    earlier blocks' layouts. None on a 1-D mesh."""
    if analysis.mesh.ndim != 2:
        return None
    g, shape = analysis.graph, analysis.mesh.shape
    producer_spec: dict[int, tuple] = {}
    choice = []
    for b in analysis.blocks:
        loops = loops_of(g.operators[b.forward.op], g)
        want = LoopKind.BATCH if any(l.kind is LoopKind.BATCH for l in loops) else LoopKind.LHS_FREE
        first = next((i for i, l in enumerate(loops) if l.kind is want), None)
        # tensor parallel on axis 1: it shards a loop of the rhs (the weight, for a layer's dots) other than
        # the batch, which is what divides parameter and optimizer memory
        options = [i for i, s in enumerate(b.strategies)
                   if s.loop_of_axis[0] == first and s.loop_of_axis[1] not in (first, None)
                   and loops[s.loop_of_axis[1]].rhs_dim is not None] or \
            [data_parallel_choice(g, [b])[0]]
        ops = set(b.operators)

        def cost(i):
            lay = analysis.layout(b.index, i)
            total = sum(c.bytes for c in lay.collectives)
            for t, spec in lay.specs:
                if g.producer.get(t) not in ops and t in producer_spec and producer_spec[t] != spec:
                    total += g.tensor(t).nbytes // max(1, shards(spec, shape))
            return total

        pick = min(options, key=lambda i: (cost(i), i))
        choice.append(pick)
        for t, spec in analysis.layout(b.index, pick).specs:
            if g.producer.get(t) in ops:
                producer_spec[t] = spec
    return tuple(choice)
