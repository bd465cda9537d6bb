"""Seen-through scans in the analysis: which loops a block may reach, views through scan ports, and the
stacked (layer or micro-batch) dims that no strategy or state sharding may cut."""
from __future__ import annotations

import json
from collections import deque

from cfp.analysis import dimflow
from cfp.ir.graph import SCAN_PORTS, OpGraph, Operator


def port_role(op: Operator) -> str:
    return json.loads(op.param("role"))


def port_view(op: Operator, perm: tuple[int, ...]) -> tuple[int, ...] | None:
    """`perm` (dims of a port's result, as dims of a viewed tensor) as dims of the port's operand; None where
    the operand is a literal or the view would need the leading dim that an exit port adds."""
    if op.inputs[0] is None:
        return None
    role = port_role(op)
    if role == "xs":
        return tuple(p + 1 for p in perm)
    if role == "ys":
        return None if 0 in perm else tuple(p - 1 for p in perm)
    return perm


def allowed_loops(graph: OpGraph, block_dots) -> list[set]:
    """Per block (its `BlockDot`s), the loops its operators may lie in: the top level
    and every loop around one of its dots. A block at top level thus never claims a body's operators, while a
    body's block reaches out to the stacked parameters and their optimizer update."""
    out = []
    for dots in block_dots:
        allowed: set = {None}
        for d in dots:
            allowed.update(graph.loop_chain(graph.operators[d.op].loop))
        out.append(allowed)
    return out


def stacked_dims(graph: OpGraph) -> dict[int, frozenset[int]]:
    """Tensor id -> its dims that are a scan's iteration dim: the leading dim of stacked operands (xs) and
    results (ys), carried along dim links (the stacked parameters' optimizer state, their gradients).
    State sharding leaves these dims whole: each iteration reads one slice, on every device."""
    cache = graph.__dict__
    if "_stacked_dims" in cache:
        return cache["_stacked_dims"]
    seeds = []
    for op in graph.operators:
        if op.primitive in SCAN_PORTS:
            role = port_role(op)
            t = op.inputs[0] if role == "xs" else op.outputs[0] if role == "ys" else None
            if t is not None:
                seeds.append((t, 0))
    found: dict[int, set[int]] = {}
    if seeds:
        adj: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for op in graph.operators:
            if op.primitive in SCAN_PORTS:
                continue
            for ta, da, tb, db in dimflow.links(op, graph):
                adj.setdefault((ta, da), []).append((tb, db))
                adj.setdefault((tb, db), []).append((ta, da))
        queue = deque(seeds)
        while queue:
            t, d = queue.popleft()
            if d in found.setdefault(t, set()):
                continue
            found[t].add(d)
            queue.extend(adj.get((t, d), ()))
    cache["_stacked_dims"] = {t: frozenset(ds) for t, ds in found.items()}
    return cache["_stacked_dims"]


def outer_source(graph: OpGraph, tid: int) -> int:
    """The tensor outside every loop that a body input comes from through enter ports (itself otherwise)."""
    while tid in graph.producer:
        op = graph.operators[graph.producer[tid]]
        if op.primitive != "scan_enter" or op.inputs[0] is None:
            break
        tid = op.inputs[0]
    return tid
