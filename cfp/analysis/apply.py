"""Apply a per-block strategy choice: shardings of inputs/outputs plus constraints, compiled with `jax.jit`.

Only JAX's public sharding API is used (`NamedSharding`, `with_sharding_constraint`, `jax.jit`). Every sharded
tensor of a block is constrained to its layout under `jax.named_scope("cfp_b<N>")`; a tensor entering a block
with another layout is constrained at that use under `cfp_reshard<N>`, so the compiled HLO tells resharding
from in-block communication.

With `shard_state` (ZeRO-3 / FSDP on top of the block strategies, per block), the step's state — every input
that comes back as an output at the same pytree path and shape: parameters and optimizer state — is stored
sharded over the mesh axes its block leaves it replicated on. Only the dots' operands of such a block are then
constrained: each dot still computes under its strategy (gathering the weight it reads), while XLA propagates
the stored sharding through the element-wise optimizer update, which turns the gradient all-reduce into a
reduce-scatter.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from cfp.analysis.analysis import Analysis
from cfp.analysis.collectives import Collective, parse_collectives
from cfp.analysis.layout import BlockLayout, DimAxes, block_layout
from cfp.errors import ConfigError
from cfp.ir.capture import Program


def partition_spec(dim_axes: DimAxes, axis_names: Sequence[str]) -> PartitionSpec:
    entries = []
    for axes in dim_axes:
        if not axes:
            entries.append(None)
        elif len(axes) == 1:
            entries.append(axis_names[axes[0]])
        else:
            entries.append(tuple(axis_names[a] for a in axes))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class AppliedPlan:
    """A strategy choice made concrete: per-block layouts and the shardings of the step's flat inputs/outputs."""

    choice: tuple[int, ...]
    layouts: tuple[BlockLayout, ...]
    input_specs: tuple[PartitionSpec, ...]
    output_specs: tuple[PartitionSpec, ...]
    shard_state: tuple[int, ...] = ()      # blocks whose parameters and optimizer state are stored sharded


def state_inputs(graph) -> tuple[int, ...]:
    """Positions of the flat inputs that the step returns updated (same pytree path and shape): its state."""
    outs = {(path, graph.tensor(t).shape) for path, t in zip(graph.output_paths or (), graph.outputs)
            if t is not None}
    return tuple(i for i, (path, t) in enumerate(zip(graph.input_paths, graph.inputs))
                 if (path, graph.tensor(t).shape) in outs)


def sharded_state_spec(spec: DimAxes, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> DimAxes:
    """`spec` with the mesh axes it leaves free added where they divide: all of them on the largest dim that
    takes them, else each (largest first) on the largest dim that still divides."""
    spec = tuple(tuple(a) for a in spec) if spec else tuple(() for _ in shape)
    free = [a for a in range(len(mesh_shape)) if not any(a in axes for axes in spec)]
    if not free or not shape:
        return spec

    def left(d, s):
        return shape[d] // math.prod(mesh_shape[a] for a in s[d])

    for group in (free, *([a] for a in sorted(free, key=lambda a: -mesh_shape[a]))):
        n = math.prod(mesh_shape[a] for a in group)
        dims = sorted((d for d in range(len(shape)) if left(d, spec) % n == 0), key=lambda d: (-left(d, spec), d))
        if dims:
            spec = tuple(axes + tuple(group) if d == dims[0] else axes for d, axes in enumerate(spec))
            if len(group) == len(free):
                break
    return spec


def state_blocks(shard_state, num_blocks: int) -> tuple[int, ...]:
    """Normalise a `shard_state` argument: True (every block), False/None (none) or block indices."""
    if shard_state is None or shard_state is False:
        return ()
    if shard_state is True:
        return tuple(range(num_blocks))
    try:
        blocks = tuple(sorted({int(b) for b in shard_state}))
    except (TypeError, ValueError):
        raise ConfigError(f"shard_state={shard_state!r} must be True, False or block indices") from None
    bad = [b for b in blocks if not 0 <= b < num_blocks]
    if bad:
        raise ConfigError(f"shard_state blocks {bad} are out of range 0..{num_blocks - 1}")
    return blocks


def state_owners(analysis: Analysis, layouts: Sequence[BlockLayout]) -> dict[int, int]:
    """Input position of each state tensor -> its block: the first whose layout gives it a spec, else the
    block of its first consumer (an optimizer-state leaf the strategies never reach)."""
    g = analysis.graph
    first: dict[int, int] = {}
    for lay in layouts:
        for t, _ in lay.specs:
            first.setdefault(t, lay.block)
    block_of_op = {op: b.index for b in analysis.blocks for op in b.operators}
    owners = {}
    for i in state_inputs(g):
        t = g.inputs[i]
        owner = first.get(t, next((block_of_op[c] for c in g.consumers.get(t, ()) if c in block_of_op), None))
        if owner is not None:
            owners[i] = owner
    return owners


def resolve(analysis: Analysis, choice: Sequence[int], shard_state=()) -> AppliedPlan:
    """Compute every block's layout and the flat input/output specs for `choice` (one index per block).

    `shard_state` (True, or block indices) stores the parameters and optimizer state those blocks own sharded
    over the mesh axes their layouts replicate them on (ZeRO-3)."""
    choice = tuple(int(c) for c in choice)
    if len(choice) != len(analysis.blocks):
        raise ConfigError(f"plan has {len(choice)} strategies, the program has {len(analysis.blocks)} blocks")
    for b, c in zip(analysis.blocks, choice):
        if not 0 <= c < len(b.strategies):
            raise ConfigError(f"strategy {c} of block {b.index} is out of range 0..{len(b.strategies) - 1}")
    g = analysis.graph
    shape = analysis.mesh.shape
    layouts = tuple(block_layout(g, b, c, shape) for b, c in zip(analysis.blocks, choice))
    names = analysis.mesh.axis_names
    first_spec: dict[int, DimAxes] = {}
    for lay in layouts:
        for t, spec in lay.specs:
            first_spec.setdefault(t, spec)
    in_dims = [first_spec.get(t, ()) for t in g.inputs]
    sharded = state_blocks(shard_state, len(analysis.blocks))
    if sharded:
        for i, owner in state_owners(analysis, layouts).items():
            if owner in sharded:
                in_dims[i] = sharded_state_spec(in_dims[i], g.tensor(g.inputs[i]).shape, shape)
    inputs = tuple(partition_spec(d, names) for d in in_dims)
    # An output at the same pytree path and shape as an input (new params and optimizer state of a train
    # step) leaves with that input's sharding, so the next step starts without resharding.
    same = {(path, g.tensor(t).shape): spec for path, t, spec in zip(g.input_paths, g.inputs, inputs)}
    outputs = tuple(
        PartitionSpec() if t is None else
        same.get((path, g.tensor(t).shape), partition_spec(first_spec.get(t, ()), names))
        for path, t in zip(g.output_paths or ("",) * len(g.outputs), g.outputs))
    return AppliedPlan(choice, layouts, inputs, outputs, sharded)


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


class ConstraintHooks:
    """Replay hooks that impose block layouts: constraints on block tensors (scope `cfp_b<N>`) and on
    tensors entering a block with another layout (scope `cfp_reshard<N>`)."""

    def __init__(self, analysis: Analysis, layouts: Sequence[BlockLayout], mesh: jax.sharding.Mesh,
                 dots_only: Sequence[int] = ()):
        g = analysis.graph
        names = analysis.mesh.axis_names
        self.block_of_op = {op: lay.block for lay in layouts for op in analysis.blocks[lay.block].operators}
        self.out_cons: dict[int, Any] = {}
        self.use_cons: dict[tuple[int, int], Any] = {}
        for lay in layouts:
            ops = set(analysis.blocks[lay.block].operators)
            pinned = _needs_constraint(g, ops, dict(lay.specs), lay.block in dots_only)
            for t, spec in lay.specs:
                if t not in pinned:
                    continue
                sharding = NamedSharding(mesh, partition_spec(spec, names))
                prod = g.producer.get(t)
                if prod in ops:
                    self.out_cons[t] = sharding
                for c in g.consumers.get(t, ()):
                    if c in ops and prod not in ops:
                        self.use_cons[(c, t)] = sharding

    def on_output(self, i, t, v):
        s = self.out_cons.get(t)
        return jax.lax.with_sharding_constraint(v, s) if s is not None else v

    def on_input(self, i, t, v):
        s = self.use_cons.get((i, t))
        if s is None:
            return v
        with jax.named_scope(f"cfp_reshard{self.block_of_op[i]}"):
            return jax.lax.with_sharding_constraint(v, s)

    def scope_of(self, i):
        b = self.block_of_op.get(i)
        return None if b is None else f"cfp_b{b}"


class ShardedStep:
    """The captured step compiled under an `AppliedPlan` on a mesh; call it like the original step."""

    def __init__(self, program: Program, analysis: Analysis, plan: AppliedPlan, mesh: jax.sharding.Mesh):
        self.program, self.analysis, self.plan, self.mesh = program, analysis, plan, mesh
        hooks = ConstraintHooks(analysis, plan.layouts, mesh, dots_only=frozenset(plan.shard_state))
        on_output, on_input, scope_of = hooks.on_output, hooks.on_input, hooks.scope_of

        def flat_fn(*flat):
            return tuple(program.replay(list(flat), on_output=on_output, scope_of=scope_of, on_input=on_input))
        self.in_shardings = tuple(NamedSharding(mesh, s) for s in plan.input_specs)
        self.out_shardings = tuple(NamedSharding(mesh, s) for s in plan.output_specs)
        self._jitted = jax.jit(flat_fn, in_shardings=self.in_shardings, out_shardings=self.out_shardings)
        self._compiled = None

    def lower(self, *args):
        flat = jax.tree_util.tree_leaves(args)
        return self._jitted.lower(*flat)

    def compile(self, *args):
        if self._compiled is None:
            self._compiled = self.lower(*args).compile()
        return self._compiled

    def shard_args(self, *args):
        """Place the step's arguments with the plan's input shardings."""
        flat, tree = jax.tree_util.tree_flatten(args)
        return jax.tree_util.tree_unflatten(tree, [jax.device_put(x, s) for x, s in zip(flat, self.in_shardings)])

    def __call__(self, *args):
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self.program.in_tree:
            raise ConfigError(f"arguments have structure {tree}, the plan was made for {self.program.in_tree}")
        out = self.compile(*args)(*flat)
        return jax.tree_util.tree_unflatten(self.program.out_tree, list(out))

    def collectives(self, *args) -> tuple[Collective, ...]:
        """Collectives XLA inserted in the compiled step, attributed to blocks."""
        return parse_collectives(self.compile(*args).as_text(), self.analysis.mesh.shape)


def apply_plan(program: Program, analysis: Analysis, choice: Sequence[int],
               mesh: jax.sharding.Mesh | None = None, shard_state=()) -> ShardedStep:
    """Build the sharded step for `choice` (one strategy index per ParallelBlock); `shard_state` (True, or
    block indices) stores those blocks' parameters and optimizer state sharded (ZeRO-3), see `resolve`."""
    if mesh is None:
        mesh = analysis.mesh.make()
    return ShardedStep(program, analysis, resolve(analysis, choice, shard_state), mesh)


def check_collectives(analysis: Analysis, plan: AppliedPlan, found: Sequence[Collective]) -> list[str]:
    """Differences between predicted and compiled in-block collectives (empty when they agree).

    Inside a block, all-reduces must be on predicted all-reduce axes and any other collective on predicted
    resharding axes; a block whose layout predicts no communication must compile without any collective.
    Resharding at block entries (`cfp_reshard<N>` scopes) is the search's business and not checked here.
    """
    problems = []
    for lay in plan.layouts:
        reduce_axes = {a for c in lay.collectives if c.kind == "all-reduce" for a in c.axes}
        reshard_axes = {a for c in lay.collectives if c.kind == "reshard" for a in c.axes}
        for c in (c for c in found if c.block == lay.block and not c.reshard):
            # XLA may split an all-reduce into reduce-scatter + all-gather around elementwise work
            decomposable = c.kind in ("all-reduce", "reduce-scatter", "all-gather")
            allowed = (reduce_axes | reshard_axes) if decomposable else reshard_axes
            if not c.axes or not set(c.axes) <= allowed:
                problems.append(
                    f"block {lay.block} strategy {lay.strategy}: unexpected {c.kind} on axes {c.axes} "
                    f"({c.bytes} B, {c.op_name}); predicted all-reduce axes {sorted(reduce_axes)}, "
                    f"reshard axes {sorted(reshard_axes)}")
    return problems
