"""Block shardings (`BlockLayout`): the sharding of every tensor of a ParallelBlock under one of its strategies.

The block's dots get their specs from the strategy (through each dot's re-index plan); the specs then flow
over the dim links of the block's other operators. Reducing a sharded dim, or contracting one, is the only
communication a block implies, plus resharding where two dots of the block want one dim sharded differently:
those are the *predicted* collectives that the compiled HLO is checked against.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque

from cfp.analysis import dimflow
from cfp.analysis.blocks import ParallelBlock, loops_of
from cfp.ir.graph import OpGraph

DimAxes = tuple[tuple[int, ...], ...]   # per tensor dim, the mesh axes sharding it


@dataclasses.dataclass(frozen=True)
class PredictedCollective:
    kind: str                 # "all-reduce", or "reshard" (any collective that moves a sharded dim)
    axes: tuple[int, ...]     # mesh axes
    bytes: int                # per-device bytes of the reduced tensor
    op: int                   # operator that causes it
    reason: str               # "contract" (sharded contracting dim) or "reduce" (reduction over a sharded dim)


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    block: int
    strategy: int
    specs: tuple[tuple[int, DimAxes], ...]      # tensor id -> dim axes (uses inside the block)
    collectives: tuple[PredictedCollective, ...]

    @property
    def spec_of(self) -> dict[int, DimAxes]:
        return dict(self.specs)


def shards(spec: DimAxes, mesh_shape: tuple[int, ...]) -> int:
    """How many pieces a tensor with this spec is cut into."""
    return math.prod(mesh_shape[a] for axes in spec for a in axes)


Spec = dict[int, list]     # tensor id -> per dim: the mesh axes sharding it, None while not reached yet


def block_layout(graph: OpGraph, block: ParallelBlock, strategy: int,
                 mesh_shape: tuple[int, ...]) -> BlockLayout:
    """The tensor layouts of `block` under `strategy` and the collectives they imply: the dots' operands and
    results laid out by the strategy, propagated through the block along dim links, the rest replicated."""
    prop = _Propagation(graph, mesh_shape)
    predicted = _seed_from_dots(graph, block, block.strategies[strategy], prop)
    op_links = {i: dimflow.links(graph.operators[i], graph) for i in block.operators}
    prop.run(op_links)
    spec = prop.spec
    predicted += _reduction_collectives(graph, block, spec, mesh_shape)
    # Whatever the strategy does not reach is replicated: constrain it so, rather than let the partitioner guess.
    for i in block.operators:
        for t in graph.operators[i].outputs:
            if t is not None and t not in spec:
                spec[t] = [()] * len(graph.tensor(t).shape)
    predicted += _reshard_collectives(graph, block, op_links, spec)
    in_block = set(block.operators)
    final = tuple((t, tuple(d or () for d in dims)) for t, dims in sorted(spec.items())
                  if t in graph.producer and graph.producer[t] in in_block or _used_in(graph, t, in_block))
    return BlockLayout(block.index, strategy, final, tuple(predicted))


class _Propagation:
    """Dim-by-dim assignment of mesh axes to tensors, then its spread along dim links (first come wins)."""

    def __init__(self, graph: OpGraph, mesh_shape: tuple[int, ...]):
        self.graph, self.mesh_shape = graph, mesh_shape
        self.spec: Spec = {}
        self.queue: deque[int] = deque()

    def assign(self, t: int, dim: int, axes: tuple[int, ...]) -> None:
        shape = self.graph.tensor(t).shape
        cur = self.spec.setdefault(t, [None] * len(shape))
        if cur[dim] is not None:
            return
        used = {a for d in cur if d for a in d}
        axes = tuple(a for a in axes if a not in used)
        if axes and shape[dim] % math.prod(self.mesh_shape[a] for a in axes):
            axes = ()
        cur[dim] = axes
        self.queue.append(t)

    def run(self, op_links: dict[int, list]) -> None:
        links_of: dict[int, list[tuple[int, int, int, int]]] = {}
        for links in op_links.values():
            for link in links:
                links_of.setdefault(link[0], []).append(link)
                links_of.setdefault(link[2], []).append((link[2], link[3], link[0], link[1]))
        while self.queue:
            t = self.queue.popleft()
            for (_, da, tb, db) in links_of.get(t, ()):
                axes = self.spec[t][da]
                if axes is not None:
                    self.assign(tb, db, axes)


def _seed_from_dots(graph: OpGraph, block: ParallelBlock, fwd, prop: _Propagation) -> list[PredictedCollective]:
    """Lay out every dot's operands and result by its strategy; the all-reduces of sharded contractions."""
    predicted = []
    for bd in block.dots:
        op = graph.operators[bd.op]
        loops = loops_of(op, graph)
        s = bd.strategy(fwd)
        for pos, side in ((0, "lhs"), (1, "rhs")):
            t = op.inputs[pos]
            for d, axes in enumerate(s.dim_axes(loops, side, len(graph.tensor(t).shape))):
                prop.assign(t, d, axes)
        out = op.outputs[0]
        for d, axes in enumerate(s.dim_axes(loops, "out", len(graph.tensor(out).shape))):
            prop.assign(out, d, axes)
        ar = s.allreduce_axes(loops)
        if ar:
            out_spec = tuple(tuple(d or ()) for d in prop.spec[out])
            nbytes = graph.tensor(out).nbytes // max(1, shards(out_spec, prop.mesh_shape))
            predicted.append(PredictedCollective("all-reduce", ar, nbytes, op.index, "contract"))
    return predicted


def _reduction_collectives(graph: OpGraph, block: ParallelBlock, spec: Spec,
                           mesh_shape: tuple[int, ...]) -> list[PredictedCollective]:
    """All-reduces of reductions over sharded dims."""
    predicted = []
    for i in block.operators:
        op = graph.operators[i]
        red = dimflow.reduced_dims(op, graph)
        if red is None or red[0] not in spec:
            continue
        t, dims = red
        axes = tuple(a for d in dims if d < len(spec[t]) for a in (spec[t][d] or ()))
        if axes:
            out = op.outputs[0]
            out_spec = spec.get(out, [])
            nbytes = graph.tensor(out).nbytes // max(1, shards(tuple(a or () for a in out_spec), mesh_shape))
            predicted.append(PredictedCollective("all-reduce", tuple(sorted(axes)), nbytes, i, "reduce"))
    return predicted


def _reshard_collectives(graph: OpGraph, block: ParallelBlock, op_links: dict[int, list],
                         spec: Spec) -> list[PredictedCollective]:
    """Resharding inside the block, so "communication-free" is only claimed when it holds."""
    predicted = []
    for i in block.operators:
        # A dim that two linked tensors shard differently (propagation met itself from two dots)
        for (ta, da, tb, db) in op_links[i]:
            if ta in spec and tb in spec:
                xa, xb = set(spec[ta][da] or ()), set(spec[tb][db] or ())
                if xa != xb:
                    nbytes = graph.tensor(ta).nbytes
                    predicted.append(PredictedCollective("reshard", tuple(sorted(xa ^ xb)), nbytes, i, "conflict"))
        op = graph.operators[i]
        if op.is_dot:
            continue
        # a sharded dim this operator does not carry over (concatenated, sliced, gathered, ...) may need
        # moving; reductions are the exception: their reduced dims are the all-reduce predicted above
        linked = {(t, d) for (ta, da, tb, db) in op_links[i] for t, d in ((ta, da), (tb, db))}
        red = dimflow.reduced_dims(op, graph)
        if red is not None:
            linked |= {(red[0], d) for d in red[1]}
        axes = {a for t in list(op.inputs) + list(op.outputs) if t in spec
                for d, dim_axes in enumerate(spec[t]) if (t, d) not in linked for a in (dim_axes or ())}
        if axes:
            predicted.append(PredictedCollective("reshard", tuple(sorted(axes)), 0, i, "unlinked dim"))
    return predicted


def _used_in(graph: OpGraph, t: int, ops: set[int]) -> bool:
    return any(c in ops for c in graph.consumers.get(t, ()))
