"""Replay hooks that impose block layouts with `with_sharding_constraint`.

Every sharded tensor of a block is constrained to its layout under `jax.named_scope("cfp_b<N>")`; a tensor
entering a block with another layout is constrained at that use under `cfp_reshard<N>`, so the compiled HLO
tells resharding from in-block communication. For a block whose state is stored sharded only the dots'
operands are constrained: each dot still computes under its strategy (gathering the weight it reads), while XLA
propagates the stored sharding through the element-wise optimizer update, which turns the gradient all-reduce
into a reduce-scatter.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from cfp.analysis.analysis import Analysis
from cfp.analysis.block_sharding import BlockLayout, DimAxes
from cfp.ir.graph import BARRIER
from cfp.sharding.reshard import direct_ok, reshard_path
from cfp.sharding.specs import StepShardings, dim_axes, partition_spec


# operators around which a free partitioner tends to pick layouts of its own (sums, scans, gathers, concats)
_PINNED_PRIMITIVES = frozenset({"add_any", "reduce_sum", "reduce_max", "cumsum", "cumprod", "cummax",
                                "concatenate", "gather", "dynamic_slice", "slice"})


def _needs_constraint(graph, ops: set[int], specs: dict, dots_only: bool = False) -> set[int]:
    """Tensors of a block to constrain: every sharded one, every tensor entering the block (resharding
    belongs at the entry, not wherever the partitioner would put it), and every operand/result of its dots,
    gradient sums (`add_any`), reductions, scans, gathers and concatenations — the places where a free
    partitioner would otherwise pick a layout of its own and move data. Other replicated intermediates (an
    optimizer update of a replicated weight, say) are left free: pinning them replicated costs memory
    (measured +42% on a data-parallel GPT step, 8.38 vs 5.92 MB per device) and buys nothing.
    """
    keep = set() if dots_only else {t for t, spec in specs.items() if any(spec) or graph.producer.get(t) not in ops}
    for i in ops:
        op = graph.operators[i]
        if op.is_dot or (op.primitive in _PINNED_PRIMITIVES and not dots_only):
            # dots_only leaves a dot's result free (a sharded contraction may then end in a reduce-scatter)
            # and the step's inputs it reads: pinning a stored-sharded weight to its gathered layout at the
            # dot made XLA keep an extra gathered copy (+0.6 MB per device on a 4-layer GPT, 2x4 mesh)
            keep.update(t for t in (*op.inputs, *(() if dots_only else op.outputs))
                        if t in specs and not (dots_only and t not in graph.producer))
    return keep


def _pin_free_exits(analysis: Analysis, layouts: Sequence[BlockLayout], pinned: dict[int, set[int]]) -> None:
    """Also pin a block's free result where another block takes it in a layout that the operator's sharded
    operand could only reach by replicating: left free, GSPMD gives the operator the consumer's layout and
    rematerializes there (seen at an `eq` of GPT's softmax on a 2x4 mesh); pinned, the entry is routed."""
    g = analysis.graph
    spec_of = {lay.block: lay.spec_of for lay in layouts}
    block_of_op = {op: lay.block for lay in layouts for op in analysis.blocks[lay.block].operators}
    for lay in layouts:
        for t, spec in lay.specs:
            a = block_of_op.get(g.producer.get(t))
            if a is None or a == lay.block or t in pinned[a] or t not in pinned[lay.block]:
                continue
            op = g.operators[g.producer[t]]
            rank = len(g.tensor(t).shape)
            if any(len(s) == rank and any(s) and not direct_ok(s, spec)
                   for s in (spec_of[a].get(u) for u in op.inputs) if s is not None):
                pinned[a].add(t)


class ConstraintHooks:
    """Replay hooks that impose block layouts: constraints on block tensors (scope `cfp_b<N>`) and on
    tensors entering a block with another layout (scope `cfp_reshard<N>`).

    `sources` gives the layouts of tensors that enter from outside the layouts (the step's inputs as stored);
    with the producers' layouts they let each entry take a path GSPMD reshards efficiently."""

    def __init__(self, analysis: Analysis, layouts: Sequence[BlockLayout], mesh: jax.sharding.Mesh,
                 dots_only: Sequence[int] = (), sources: Mapping[int, DimAxes] | None = None):
        g, names = analysis.graph, analysis.mesh.axis_names
        self.block_of_op = {op: lay.block for lay in layouts for op in analysis.blocks[lay.block].operators}
        pinned = {lay.block: _needs_constraint(g, set(analysis.blocks[lay.block].operators), dict(lay.specs),
                                               lay.block in dots_only) for lay in layouts}
        _pin_free_exits(analysis, layouts, pinned)
        produced = dict(sources or {})
        for lay in layouts:
            ops = analysis.blocks[lay.block].operators
            produced.update((t, spec) for t, spec in lay.specs
                            if t in pinned[lay.block] and g.producer.get(t) in ops)
        self.out_cons: dict[int, Any] = {}
        self.use_cons: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._pass_through_barriers(g, produced, mesh, names)
        for lay in layouts:
            ops = set(analysis.blocks[lay.block].operators)
            for t, spec in lay.specs:
                if t not in pinned[lay.block]:
                    continue
                prod = g.producer.get(t)
                if prod in ops:
                    self.out_cons[t] = self._sharding(mesh, names, spec)
                    continue
                path = ((spec,) if t not in produced
                        else reshard_path(produced[t], spec, g.tensor(t).shape, analysis.mesh.shape))
                for c in g.consumers.get(t, ()):
                    if c in ops:
                        self.use_cons[(c, t)] = tuple(self._sharding(mesh, names, s) for s in path)

    def _pass_through_barriers(self, g, produced: dict, mesh, names) -> None:
        """A remat's optimization barrier (an identity per operand, outside every block) keeps each operand's
        layout: left free, the partitioner gave its results layouts of their own and then replicated to
        reach the blocks that read them (seen on a rematerialised transformer, 2x4 mesh)."""
        for op in g.operators:
            if op.primitive != BARRIER:
                continue
            for t_in, t_out in zip(op.inputs, op.outputs):
                if t_in in produced and t_out is not None:
                    produced[t_out] = produced[t_in]
                    self.out_cons[t_out] = self._sharding(mesh, names, produced[t_in])

    @classmethod
    def for_step(cls, analysis: Analysis, shardings: StepShardings, mesh: jax.sharding.Mesh) -> "ConstraintHooks":
        """The hooks that impose `shardings` on the analysed step: its block layouts, state-sharded blocks
        constrained at their dots only, and each step input entering its blocks from its stored layout."""
        g, names = analysis.graph, analysis.mesh.axis_names
        stored = {t: dim_axes(s, names, len(g.tensor(t).shape)) for t, s in zip(g.inputs, shardings.input_specs)}
        return cls(analysis, shardings.layouts, mesh, dots_only=frozenset(shardings.shard_state), sources=stored)

    def sliced(self, dims: Mapping[int, int]) -> "ConstraintHooks":
        """These hooks for a program that holds the tensors of `dims` (tensor -> stacked dim) as one iteration's
        slice (a loop body's segment with its layer's share of the optimizer update): their constraints leave
        the stacked dim out (it is never sharded)."""
        out = copy.copy(self)
        out.out_cons = {t: _drop_dim(s, dims[t]) if t in dims else s for t, s in self.out_cons.items()}
        out.use_cons = {(i, t): tuple(_drop_dim(s, dims[t]) for s in path) if t in dims else path
                        for (i, t), path in self.use_cons.items()}
        return out

    @staticmethod
    def _sharding(mesh: jax.sharding.Mesh, names, spec: DimAxes) -> NamedSharding:
        return NamedSharding(mesh, partition_spec(spec, names))

    def on_output(self, i, t, v):
        s = self.out_cons.get(t)
        return jax.lax.with_sharding_constraint(v, s) if s is not None else v

    def on_input(self, i, t, v):
        path = self.use_cons.get((i, t))
        if path is None:
            return v
        with jax.named_scope(f"cfp_reshard{self.block_of_op[i]}"):
            for s in path:
                v = jax.lax.with_sharding_constraint(v, s)
            return v

    def scope_of(self, i):
        b = self.block_of_op.get(i)
        return None if b is None else f"cfp_b{b}"


def _drop_dim(sharding: NamedSharding, dim: int) -> NamedSharding:
    """`sharding` of a tensor for its slice without dim `dim` (an unsharded stacked dim)."""
    entries = list(sharding.spec)
    if dim < len(entries):
        if entries[dim] is not None:
            raise ValueError(f"stacked dim {dim} is sharded in {sharding.spec}; a slice cannot drop it")
        del entries[dim]
    return NamedSharding(sharding.mesh, PartitionSpec(*entries))
