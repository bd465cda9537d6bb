"""The step's state: which flat inputs it returns updated (parameters and optimizer state), found from the
captured program or named by the user. Every pass that treats state apart reads it here: the analysis (state
is not an activation), the sharding (donated buffers, sharded state) and the API (a user's mapping)."""
from __future__ import annotations

from cfp.errors import ConfigError


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
