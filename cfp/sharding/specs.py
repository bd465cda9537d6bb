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
from cfp.analysis.layout import BlockLayout, DimAxes, shards
from cfp.analysis.loops import stacked_dims
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


def state_pairs(graph) -> tuple[tuple[int, int], ...]:
    """(input position, output position) of every flat input the step returns updated: its state (parameters
    and optimizer state), found from the program whatever the order of arguments and outputs.

    An output is the new value of the input of the same shape and dtype it is computed from through
    shape-preserving, non-contracting operators (an optimizer update `p - lr * u`, `b1 * mu + ...`, or the
    input returned as is); among several, the nearest wins, then the one at the same pytree path. An output
    at the same pytree path, shape and dtype as an input is its new value too (an update hidden behind an
    opaque operator). `set_state_pairs` overrides all of this with the user's mapping."""
    cache = graph.__dict__          # not a field: neither serialised nor compared, like Analysis' layouts
    if "_state_pairs" not in cache:
        cache["_state_pairs"] = _found_state_pairs(graph)
    return cache["_state_pairs"]


def set_state_pairs(graph, pairs) -> None:
    """Name the step's state explicitly: (input position, output position) pairs of equal shape and dtype."""
    pairs = tuple((int(i), int(o)) for i, o in pairs)
    for i, o in pairs:
        if not (0 <= i < len(graph.inputs) and 0 <= o < len(graph.outputs)) or graph.outputs[o] is None:
            raise ConfigError(f"state pair (input {i}, output {o}) is out of range: the step has "
                              f"{len(graph.inputs)} flat inputs and {len(graph.outputs)} flat outputs")
        a, b = graph.tensor(graph.inputs[i]), graph.tensor(graph.outputs[o])
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ConfigError(f"state input {graph.input_paths[i]} is {a.short()} but the output named as its "
                              f"new value is {b.short()}")
    if len({i for i, _ in pairs}) != len(pairs) or len({o for _, o in pairs}) != len(pairs):
        raise ConfigError("state mapping pairs an input or an output twice")
    graph.__dict__["_state_pairs"] = pairs


def mapping_pairs(in_tree, out_tree, mapping) -> tuple[tuple[int, int], ...]:
    """Flat (input, output) pairs of a user's state mapping {argument index: output index}: argument `a` of
    the step comes back, leaf for leaf, as element `o` of its output tuple (a lone output is element 0)."""
    def ranges(tree, lone):
        kids = [tree] if lone else tree.children()
        starts = [0]
        for k in kids:
            starts.append(starts[-1] + k.num_leaves)
        return kids, starts
    if not isinstance(mapping, dict):
        raise ConfigError(f"state={mapping!r} must map argument indices to output indices, e.g. {{0: 1, 3: 2}}")
    ins, in_at = ranges(in_tree, False)
    data = out_tree.node_data()
    outs, out_at = ranges(out_tree, data is None or data[0] not in (tuple, list))
    pairs = []
    for a, o in mapping.items():
        if not (isinstance(a, int) and 0 <= a < len(ins) and isinstance(o, int) and 0 <= o < len(outs)):
            raise ConfigError(f"state mapping {a!r}: {o!r} is out of range: the step takes {len(ins)} arguments "
                              f"and returns {len(outs)} outputs")
        if ins[a].num_leaves != outs[o].num_leaves:
            raise ConfigError(f"state mapping {a}: {o}: argument {a} has {ins[a].num_leaves} array leaves, "
                              f"output {o} has {outs[o].num_leaves}")
        pairs += [(in_at[a] + k, out_at[o] + k) for k in range(ins[a].num_leaves)]
    return tuple(pairs)


def state_inputs(graph) -> tuple[int, ...]:
    """Positions of the flat inputs that the step returns updated: its state (see `state_pairs`)."""
    return tuple(sorted(i for i, _ in state_pairs(graph)))


def _suffix(path: str) -> str:
    """A flat path without its leading argument/output index: "[3][0].mu['w']" -> "[0].mu['w']"."""
    return path.split("]", 1)[1] if path.startswith("[") and "]" in path else path


def _sources(graph, out: int) -> dict[int, int]:
    """Flat input position -> distance, for inputs of the output tensor's shape and dtype it is computed from
    through shape-preserving, non-contracting operators."""
    want = graph.tensor(out)
    found, seen, frontier, depth = {}, {out}, [out], 0
    while frontier:
        nxt = []
        for t in frontier:
            if t in graph.input_position and graph.tensor(t).dtype == want.dtype:
                found.setdefault(graph.input_position[t], depth)
            op = graph.operators[graph.producer[t]] if t in graph.producer else None
            if op is None or op.is_dot or op.opaque:
                continue
            for u in op.inputs:
                if u is not None and u not in seen and graph.tensor(u).shape == want.shape:
                    seen.add(u)
                    nxt.append(u)
        frontier, depth = nxt, depth + 1
    return found


def _found_state_pairs(graph) -> tuple[tuple[int, int], ...]:
    in_paths = graph.input_paths
    out_paths = graph.output_paths or ("",) * len(graph.outputs)
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    by_path = {(p, graph.tensor(t).shape, graph.tensor(t).dtype): i
               for i, (p, t) in enumerate(zip(in_paths, graph.inputs))}
    for o, (p, t) in enumerate(zip(out_paths, graph.outputs)):
        if t is None:
            continue
        srcs = _sources(graph, t)
        ranked = sorted(srcs, key=lambda i: (srcs[i], _suffix(in_paths[i]) != _suffix(p), i))
        i = next((i for i in ranked if i not in taken), None)
        if i is None:
            i = by_path.get((p, graph.tensor(t).shape, graph.tensor(t).dtype))
            i = None if i in taken else i
        if i is not None:
            pairs[o] = i
            taken.add(i)
    return tuple(sorted((i, o) for o, i in pairs.items()))


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
