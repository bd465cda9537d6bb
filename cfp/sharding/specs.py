"""A strategy choice made concrete: every block's layout and the shardings of the step's flat inputs/outputs.

With `shard_state` (ZeRO-3 / FSDP on top of the block strategies, per block), the step's state — every input
the step returns updated (`state_pairs`): parameters and optimizer state — is stored sharded over the mesh
axes its block leaves it replicated on.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jax.sharding import PartitionSpec

from cfp.analysis.analysis import Analysis
from cfp.analysis.block_sharding import BlockLayout, DimAxes, shards
from cfp.analysis.loops import stacked_dims
from cfp.errors import ConfigError
from cfp.ir.state import state_inputs, state_pairs


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
    # False: only the inputs and outputs are placed, nothing inside the step is constrained (the layouts users
    # write, `cfp.baselines.user_layouts`); XLA propagates the rest
    constrained: bool = True


def donated_bytes(analysis: Analysis, shardings: "StepShardings") -> int:
    """Per-device bytes of the state inputs a donating step hands over to its outputs (counted once)."""
    g, names, shape = analysis.graph, analysis.mesh.axis_names, analysis.mesh.shape
    total = 0
    for i, _ in state_pairs(g):
        t = g.tensor(g.inputs[i])
        total += t.nbytes // shards(dim_axes(shardings.input_specs[i], names, len(t.shape)), shape)
    return total


def sharded_state_spec(spec: DimAxes, shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                       whole: frozenset[int] = frozenset()) -> DimAxes:
    """`spec` with the mesh axes it leaves free added where they divide: all of them on the largest dim that
    takes them, else each (largest first) on the largest dim that still divides; never on the dims `whole`
    (a scan's stacked layer dim: each iteration reads one layer's slice, which every device needs)."""
    spec = tuple(tuple(a) for a in spec) if spec else tuple(() for _ in shape)
    free = [a for a in range(len(mesh_shape)) if not any(a in axes for axes in spec)]
    if not free or not shape:
        return spec

    def left(d, s):
        return shape[d] // math.prod(mesh_shape[a] for a in s[d])

    for group in (free, *([a] for a in sorted(free, key=lambda a: -mesh_shape[a]))):
        n = math.prod(mesh_shape[a] for a in group)
        dims = sorted((d for d in range(len(shape)) if left(d, spec) % n == 0 and d not in whole),
                      key=lambda d: (-left(d, spec), d))
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


# operators that cut a batch into micro-batches without computing on it
_SPLIT_OPS = {"reshape", "slice", "dynamic_slice", "squeeze", "expand_dims", "convert_element_type", "copy"}


def reshaped_batch_spec(graph, tid: int, first_spec: dict, mesh_shape: tuple[int, ...]) -> DimAxes:
    """The spec of a flat input no block reads directly but whose reshaped or sliced pieces blocks shard (a batch
    cut into micro-batches inside the step): its leading dim over the mesh axes that shard those pieces, so
    each device receives its share rather than the whole global batch; () when nothing tells."""
    shape = graph.tensor(tid).shape
    axes: list[int] = []
    seen, frontier = {tid}, [tid]
    while frontier:
        nxt = []
        for t in frontier:
            for a in (a for dims in first_spec.get(t, ()) for a in dims):
                if a not in axes:
                    axes.append(a)
            for c in graph.consumers.get(t, ()):
                op = graph.operators[c]
                if op.primitive in _SPLIT_OPS and op.inputs and op.inputs[0] == t:
                    nxt += [u for u in op.outputs if u is not None and u not in seen]
                    seen.update(nxt)
        frontier = nxt
    if not shape or not axes:
        return ()
    for group in (axes, *([a] for a in sorted(axes, key=lambda a: -mesh_shape[a]))):
        if shape[0] % math.prod(mesh_shape[a] for a in group) == 0:
            return (tuple(sorted(group)),) + tuple(() for _ in shape[1:])
    return ()


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
    state = set(state_inputs(g))
    for i, t in enumerate(g.inputs):
        if i not in state and not any(in_dims[i]):
            in_dims[i] = reshaped_batch_spec(g, t, first_spec, shape)
    sharded = state_blocks(shard_state, len(analysis.blocks))
    if sharded:
        stacked = stacked_dims(g)
        for i, owner in state_owners(analysis, layouts).items():
            if owner in sharded:
                in_dims[i] = sharded_state_spec(in_dims[i], g.tensor(g.inputs[i]).shape, shape,
                                                stacked.get(g.inputs[i], frozenset()))
    inputs = tuple(partition_spec(d, names) for d in in_dims)
    # A state output (new params and optimizer state of a train step) leaves with exactly its input's
    # sharding, so the step chains in a loop without resharding and its buffers can be donated.
    same = {o: inputs[i] for i, o in state_pairs(g)}
    outputs = tuple(PartitionSpec() if t is None else same.get(o, partition_spec(first_spec.get(t, ()), names))
                    for o, t in enumerate(g.outputs))
    return StepShardings(choice, layouts, inputs, outputs, sharded)
