"""ParallelBlocks (CFP §ParallelBlock): a forward dot, its backward dots and the operators its sharding reaches.

1. Each forward dot opens a block. Differentiation keeps the user frame and module scope of the operation it
   transposes, so a backward dot belongs to the forward dot with the same (scope, source); operand identity
   breaks ties (a weight gradient reads the forward's saved input, a data gradient reads the weight).
   Under remat (`jax.checkpoint`) the backward pass also recomputes forward dots; a recomputed dot has the
   forward's key, dimension numbers and operand shapes, and joins its block with the identity loop map.
2. A re-index *loop map* maps each backward loop onto a forward loop through the operands they share, so one
   strategy index (over the forward dot's strategies) fixes the sharding of every dot in the block.
3. Every other operator joins the block nearest to it in the dataflow graph (breadth-first from all dots at
   once; ties go to the earlier block). Opaque control flow and operators no dot reaches form the remainder.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections import deque

from cfp.analysis.strategies import (DotStrategy, Loop, batch_loop_order, dot_loops,
                                     enumerate_strategies)
from cfp.analysis.loops import allowed_loops, port_role, port_view
from cfp.ir.graph import BARRIER, SCAN_PORTS, OpGraph, Operator
from cfp.ir.state import state_inputs

_VIEW_OPS = {"convert_element_type", "copy", "transpose", "reduce_precision", "copy_p"}


class DotRole(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"      # a forward dot recomputed in the backward pass (remat)


@dataclasses.dataclass(frozen=True)
class BlockDot:
    """A dot of a block; `loop_map[i]` is the forward loop that this dot's loop i follows (None: unmatched)."""

    op: int
    role: DotRole
    loop_map: tuple[int | None, ...]

    def strategy(self, forward: DotStrategy) -> DotStrategy:
        """This dot's strategy when the block's forward dot uses `forward`."""
        return DotStrategy(tuple(
            (self.loop_map.index(fl) if fl is not None and fl in self.loop_map else None) for fl in forward.loop_of_axis))


@dataclasses.dataclass(frozen=True)
class ParallelBlock:
    index: int
    dots: tuple[BlockDot, ...]
    operators: tuple[int, ...]          # every operator of the block, dots included, in program order
    strategies: tuple[DotStrategy, ...]  # the forward dot's strategies: the block's decision variable
    fingerprint: str
    scope: tuple[str, ...]

    @property
    def forward(self) -> BlockDot:
        return self.dots[0]


def loops_of(op: Operator, graph: OpGraph) -> tuple[Loop, ...]:
    lhs, rhs = op.inputs[0], op.inputs[1]
    return dot_loops(graph.tensor(lhs).shape, graph.tensor(rhs).shape, op.dot)


def forward_twins(graph: OpGraph) -> dict[int, int]:
    """Tensor -> the forward tensor holding the same value, for what a remat's barrier passes on and what its
    recomputation recomputes (empty without remat). Value numbering: a recomputed operator is the twin of the
    first not yet claimed forward operator with the same primitive, params and (twinned) inputs -- the
    recomputation replays the forward operators in their order. Computed once per graph."""
    cached = graph.__dict__.get("_forward_twins")
    if cached is not None:
        return cached
    twin: dict[int, int] = {}
    claimed: set[int] = set()
    remat = any(op.recomputed for op in graph.operators)
    entered: dict[tuple[int, str], int] = {}
    for op in graph.operators:
        if remat and op.primitive == "scan_enter":
            _port_twin(graph, op, twin, entered)
            continue
        if op.primitive == BARRIER:
            twin.update((o, twin.get(i, i)) for i, o in zip(op.inputs, op.outputs) if i is not None and o is not None)
            continue
        if not op.recomputed:
            continue
        ins = tuple(None if t is None else twin.get(t, t) for t in op.inputs)
        anchor = next((t for t in ins if t is not None), None)
        for c in graph.consumers.get(anchor, ()) if anchor is not None else ():
            f = graph.operators[c]
            if (c not in claimed and not f.recomputed and f.primitive == op.primitive and f.inputs == ins
                    and f.params == op.params and f.dot == op.dot):
                claimed.add(c)
                twin.update((a, b) for a, b in zip(op.outputs, f.outputs) if a is not None and b is not None)
                break
    graph.__dict__["_forward_twins"] = twin     # not a field: the graph stays frozen and comparable
    return twin


def _port_twin(graph: OpGraph, op: Operator, twin: dict[int, int], entered: dict[tuple[int, str], int]) -> None:
    """Under remat in a scan body, the backward scan's recomputation reads its operands through its own enter
    ports: one layer's slice of a stacked operand the forward scan also sliced (a stacked weight), or of what
    the forward scan stacked as its output (a saved activation). Either slice, at the same iteration, is the
    forward body's value, so the port's output twins it (the carry, which changes every iteration, never)."""
    src, out = op.inputs[0], op.outputs[0]
    role = port_role(op)
    if src is None or out is None or role == "carry":
        return
    prod = graph.producer.get(src)
    if role == "xs" and prod is not None and graph.operators[prod].primitive == "scan_exit" \
            and port_role(graph.operators[prod]) == "ys" and graph.operators[prod].inputs[0] is not None:
        inner = graph.operators[prod].inputs[0]
        twin[out] = twin.get(inner, inner)
    elif (src, role) in entered:
        twin[out] = entered[(src, role)]
    else:
        entered[(src, role)] = out


def trace_view(graph: OpGraph, tid: int) -> tuple[int, tuple[int, ...]]:
    """Follow dtype converts, transposes and scan ports back to a source tensor: (source, dim of source per
    dim). Through a stacked port (xs in, ys out) the dims shift by the leading iteration dim, so a backward
    scan body's saved activation or weight slice leads to the forward body's tensor or the stacked weight.
    A remat's copies (barrier outputs, recomputed values) are followed to the forward tensor they copy."""
    perm = tuple(range(len(graph.tensor(tid).shape)))
    twins = forward_twins(graph)
    tid = twins.get(tid, tid)
    while tid in graph.producer:
        op = graph.operators[graph.producer[tid]]
        if op.primitive in SCAN_PORTS:
            shifted = port_view(op, perm)
            if shifted is None:
                break
            perm, tid = shifted, twins.get(op.inputs[0], op.inputs[0])
            continue
        if op.primitive not in _VIEW_OPS or op.inputs[0] is None:
            break
        if op.primitive == "transpose":
            p = [int(x) for x in op.param("permutation").strip("[]").split(",") if x.strip()]
            perm = tuple(p[d] for d in perm)
        tid = twins.get(op.inputs[0], op.inputs[0])
    return tid, perm


def _loop_map(fwd: Operator, bwd: Operator, graph: OpGraph) -> tuple[int | None, ...]:
    f_loops = loops_of(fwd, graph)
    b_loops = loops_of(bwd, graph)
    f_lhs, f_rhs, f_out = fwd.inputs[0], fwd.inputs[1], fwd.outputs[0]
    # forward operands by their source tensor, with the map from a source dim back to the operand's dim
    # (the forward operand may itself be a transposed view of the source that the backward dot reads)
    f_src = {}
    for side, t in (("lhs", f_lhs), ("rhs", f_rhs)):
        src, perm = trace_view(graph, t)
        f_src[src] = (side, {s: d for d, s in enumerate(perm)})
    loop_by_dim = {(side, getattr(l, f"{side}_dim")): i for i, l in enumerate(f_loops)
                   for side in ("lhs", "rhs", "out") if getattr(l, f"{side}_dim") is not None}
    shapes = {"lhs": graph.tensor(f_lhs).shape, "rhs": graph.tensor(f_rhs).shape, "out": graph.tensor(f_out).shape}
    sides: list[tuple[str, tuple[int, ...]] | None] = []
    used: set[str] = set()
    for operand in (bwd.inputs[0], bwd.inputs[1]):
        src, perm = trace_view(graph, operand)
        side, to_fwd = f_src.get(src, (None, None))
        if side is not None and side not in used:
            perm = tuple(to_fwd[p] for p in perm)
        else:
            # not a forward operand: the cotangent of the forward output, or a recomputed operand
            shape = graph.tensor(operand).shape
            side = next((s for s in ("out", "lhs", "rhs") if s not in used and shapes[s] == shape), None)
            perm = tuple(range(len(shape)))
        if side is not None:
            used.add(side)
            sides.append((side, perm))
        else:
            sides.append(None)
    loop_map = []
    for loop in b_loops:
        fl = None
        for k, dim in enumerate((loop.lhs_dim, loop.rhs_dim)):
            if dim is not None and sides[k] is not None:
                side, perm = sides[k]
                fl = loop_by_dim.get((side, perm[dim]))
                if fl is not None:
                    break
        loop_map.append(fl)
    return tuple(loop_map)


def _is_recompute(fwd: Operator, bwd: Operator, graph: OpGraph) -> bool:
    """Whether `bwd` is `fwd` recomputed under remat: same dimension numbers and operand shapes."""
    shape = lambda t: graph.tensor(t).shape
    return bwd.recomputed and fwd.dot == bwd.dot and all(
        shape(f) == shape(b) for f, b in zip(fwd.inputs[:2], bwd.inputs[:2]))


def _member(fwd: Operator, bwd: Operator, graph: OpGraph) -> BlockDot:
    if _is_recompute(fwd, bwd, graph):
        return BlockDot(bwd.index, DotRole.RECOMPUTE, tuple(range(len(loops_of(fwd, graph)))))
    return BlockDot(bwd.index, DotRole.BACKWARD, _loop_map(fwd, bwd, graph))


def _source_key(op: Operator) -> tuple:
    return (op.scope, op.source)


def _shares_operand(fwd: Operator, bwd: Operator, graph: OpGraph) -> bool:
    f = {trace_view(graph, t)[0] for t in fwd.inputs[:2]}
    return any(trace_view(graph, t)[0] in f for t in bwd.inputs[:2])


def _fingerprint(fwd: Operator, dots: list[BlockDot], graph: OpGraph) -> str:
    parts = [graph.tensor(fwd.inputs[0]).short(), graph.tensor(fwd.inputs[1]).short(), repr(fwd.dot)]
    parts += [f"{d.role.value}:{d.loop_map}" for d in dots[1:]]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def _forward_of(b: Operator, by_key: dict[tuple, list[Operator]], graph: OpGraph) -> Operator | None:
    """The forward dot a backward or recomputed dot `b` belongs to (None: no forward dot has its key)."""
    twin = forward_twins(graph).get(b.outputs[0])
    if b.recomputed and twin in graph.producer:      # a recomputed dot: its forward twin, exactly
        f = graph.operators[graph.producer[twin]]
        if f.is_dot and not f.backward:
            return f
    cands = by_key.get(_source_key(b), [])
    if len(cands) > 1:
        sharing = [f for f in cands if _shares_operand(f, b, graph)]
        cands = sharing or cands
        # among equals, the latest forward dot before the backward one is the likeliest (reverse order)
    return cands[-1] if cands else None


def build_blocks(graph: OpGraph, mesh_shape: tuple[int, ...]) -> tuple[tuple[ParallelBlock, ...], tuple[int, ...]]:
    """Group the graph's operators into ParallelBlocks; returns (blocks, remainder operator indices)."""
    dots = graph.dots
    forward = [d for d in dots if not d.backward]
    by_key: dict[tuple, list[Operator]] = {}
    for f in forward:
        by_key.setdefault(_source_key(f), []).append(f)
    members: dict[int, list[BlockDot]] = {f.index: [] for f in forward}
    lone: list[Operator] = []
    for b in (d for d in dots if d.backward):
        f = _forward_of(b, by_key, graph)
        if f is None:
            lone.append(b)
        else:
            members[f.index].append(_member(f, b, graph))
    heads = sorted(forward + lone, key=lambda o: o.index)
    block_of: dict[int, int] = {}
    block_dots: list[list[BlockDot]] = []
    for bi, head in enumerate(heads):
        n = len(loops_of(head, graph))
        ds = [BlockDot(head.index, DotRole.FORWARD, tuple(range(n)))] + members.get(head.index, [])
        block_dots.append(ds)
        for d in ds:
            block_of[d.op] = bi
    _attach(graph, block_of, allowed_loops(graph, block_dots))
    blocks = []
    ops_of: dict[int, list[int]] = {}
    for op_index, bi in block_of.items():
        ops_of.setdefault(bi, []).append(op_index)
    for bi, head in enumerate(heads):
        ds = block_dots[bi]
        blocks.append(ParallelBlock(
            index=bi, dots=tuple(ds), operators=tuple(sorted(ops_of.get(bi, []))),
            strategies=enumerate_strategies(loops_of(head, graph), mesh_shape),
            fingerprint=_fingerprint(head, ds, graph), scope=head.scope))
    remainder = tuple(op.index for op in graph.operators if op.index not in block_of)
    return tuple(blocks), remainder


def _attach(graph: OpGraph, block_of: dict[int, int], allowed: list[set] | None = None) -> None:
    """Multi-source BFS from the dots over producer/consumer edges; opaque operators and remat barriers (which
    tie together every operand of a layer's backward pass) are never crossed, and a block enters no scan body
    but those of its own dots (`allowed`: per block, the loops it may reach)."""
    queue = deque(sorted(block_of, key=lambda i: (block_of[i], i)))
    ops = graph.operators
    while queue:
        i = queue.popleft()
        op = ops[i]
        neighbours: list[int] = []
        for t in op.inputs:
            if t is not None and t in graph.producer:
                neighbours.append(graph.producer[t])
        for t in op.outputs:
            if t is not None:
                neighbours.extend(graph.consumers.get(t, ()))
        for j in neighbours:
            if (j not in block_of and not ops[j].opaque and not ops[j].is_dot and ops[j].primitive != BARRIER
                    and (allowed is None or ops[j].loop in allowed[block_of[i]])):
                block_of[j] = block_of[i]
                queue.append(j)


def data_parallel_choice(graph: OpGraph, blocks) -> tuple[int, ...]:
    """Per block, the strategy sharding one batch-like loop on every mesh axis: the uniform data-parallel choice.

    Candidates in order (`batch_loop_order`): the forward dot's batch loops, then the free loops of its operand
    that is not a parameter (`parameter_operand`); the first that some strategy puts on every mesh axis wins
    (an expert loop too small for the mesh gives way to the token groups). Blocks with none keep strategy 0."""
    choice = []
    for b in blocks:
        op = graph.operators[b.forward.op]
        order = batch_loop_order(loops_of(op, graph), parameter_operand(graph, op))
        pick = next((k for loop in order for k, s in enumerate(b.strategies)
                     if set(s.loop_of_axis) == {loop}), 0)
        choice.append(pick)
    return tuple(choice)


def parameter_operand(graph: OpGraph, op: Operator) -> str | None:
    """"lhs" or "rhs": the dot operand that is a parameter — read (through views) from a flat input the step
    returns updated, else from a flat input while the other operand is computed — or None when that does not
    tell them apart."""
    state = {graph.inputs[i] for i in state_inputs(graph)}
    srcs = [trace_view(graph, t)[0] for t in op.inputs[:2]]
    for test in (lambda t: t in state, lambda t: t in graph.input_position):
        hit = [test(t) for t in srcs]
        if hit[0] != hit[1]:
            return "lhs" if hit[0] else "rhs"
    return None
