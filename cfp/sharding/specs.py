"""A strategy choice made concrete: every block's layout and the shardings of the step's flat inputs/outputs.

With `shard_state` (ZeRO-3 / FSDP on top of the block strategies, per block), the step's state — every input
that comes back as an output at the same pytree path and shape: parameters and optimizer state — is stored
sharded over the mesh axes its block leaves it replicated on.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jax.sharding import PartitionSpec

from cfp.analysis.analysis import Analysis
from cfp.analysis.layout import BlockLayout, DimAxes
from cfp.errors import ConfigError


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


def dim_axes(spec: PartitionSpec, axis_names: Sequence[str], rank: int) -> DimAxes:
    """The inverse of `partition_spec` for a tensor of `rank` dims."""
    out = []
    for d in range(rank):
        entry = spec[d] if d < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(tuple(axis_names.index(n) for n in names))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StepShardings:
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


def resolve(analysis: Analysis, choice: Sequence[int], shard_state=()) -> StepShardings:
    """Compute every block's layout and the flat input/output specs for `choice` (one index per block).

    `shard_state` (True, or block indices) stores the parameters and optimizer state those blocks own sharded
    over the mesh axes their layouts replicate them on (ZeRO-3)."""
    choice = tuple(int(c) for c in choice)
    if len(choice) != len(analysis.blocks):
        raise ConfigError(f"choice has {len(choice)} strategies, the program has {len(analysis.blocks)} blocks")
    for b, c in zip(analysis.blocks, choice):
        if not 0 <= c < len(b.strategies):
            raise ConfigError(f"strategy {c} of block {b.index} is out of range 0..{len(b.strategies) - 1}")
    g = analysis.graph
    shape = analysis.mesh.shape
    layouts = tuple(analysis.layout(b.index, c) for b, c in zip(analysis.blocks, choice))
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
    return StepShardings(choice, layouts, inputs, outputs, sharded)
