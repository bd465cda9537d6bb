"""Segments: repeated ParallelBlock sequences (one transformer layer), found by structural fingerprints.

The block sequence is cut where the module scope changes one level below the common root (Flax/Haiku module
paths such as `layers_3`); programs without scopes fall back to the longest tandem repeat of block
fingerprints. A segment's fingerprint is its blocks' fingerprints plus its internal dependency edges with the
dims they carry, so equal fingerprints profile once. The CFP original hard-codes MoE's (0,8)/(8,14) layer
pair; this matcher is general.
"""
from __future__ import annotations

import dataclasses
import hashlib

from cfp.analysis.blocks import ParallelBlock
from cfp.ir.graph import OpGraph


@dataclasses.dataclass(frozen=True)
class Segment:
    """Blocks [start, stop) of the block sequence; `kind` indexes the unique segment types."""

    index: int
    start: int
    stop: int
    kind: int
    mapped_to: tuple[int, int]   # (start, stop) of the first segment of the same kind
    fingerprint: str
    loop: int | None = None      # the scan whose body holds its blocks' forward dots (None: top level)
    repeat: int = 1              # how many times it runs per step (the trip counts of the loops around it)

    @property
    def blocks(self) -> range:
        return range(self.start, self.stop)


def _scope_groups(blocks: tuple[ParallelBlock, ...]) -> list[tuple[int, int]] | None:
    scopes = [b.scope for b in blocks]
    if not scopes:
        return None
    common = 0
    while all(len(s) > common for s in scopes) and len({s[common] for s in scopes}) == 1:
        common += 1
    keys = [s[common] if len(s) > common else None for s in scopes]
    if len(set(keys)) < 2:
        return None
    groups, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            groups.append((start, i))
            start = i
    return groups


def _tandem_groups(fps: list[str]) -> list[tuple[int, int]]:
    """Cut at the tandem repeat covering the most blocks (ties: shorter period), recursing on both sides."""
    def solve(lo: int, hi: int) -> list[tuple[int, int]]:
        n = hi - lo
        best = None  # (coverage, -period, start, period, count)
        for p in range(1, n // 2 + 1):
            for s in range(lo, hi - 2 * p + 1):
                k = 1
                while s + (k + 1) * p <= hi and fps[s + k * p: s + (k + 1) * p] == fps[s: s + p]:
                    k += 1
                if k >= 2:
                    cand = (k * p, -p, s, p, k)
                    if best is None or cand[:2] > best[:2]:
                        best = cand
        if best is None:
            return [(lo, hi)] if hi > lo else []
        _, _, s, p, k = best
        return solve(lo, s) + [(s + i * p, s + (i + 1) * p) for i in range(k)] + solve(s + k * p, hi)
    return solve(0, len(fps))


def _upstream_dots(graph: OpGraph, tid: int, limit: int = 200) -> set[int]:
    """The nearest dots a tensor depends on, walking producers backwards through non-dot operators."""
    found, stack, seen = set(), [tid], set()
    while stack and len(seen) < limit:
        t = stack.pop()
        if t is None or t in seen or t not in graph.producer:
            continue
        seen.add(t)
        op = graph.operators[graph.producer[t]]
        if op.is_dot:
            if not op.backward:
                found.add(op.index)
        else:
            stack.extend(op.inputs)
    return found


def _segment_fingerprint(graph: OpGraph, blocks: tuple[ParallelBlock, ...], start: int, stop: int) -> str:
    """Block fingerprints plus forward dot-to-dot dependency edges (with the shapes they carry).

    Edges are taken between forward dots, not between all attached operators: attachment of shared scalars
    (loss scaling, optimizer counters) and the backward chain differ between the first and last layer and
    the others, while the backward structure follows from the forward one anyway.
    """
    block_of = {b.forward.op: b.index for b in blocks[start:stop]}
    edges = set()
    for b in blocks[start:stop]:
        for d in b.dots[:1]:
            op = graph.operators[d.op]
            for pos, t in enumerate(op.inputs[:2]):
                for src in _upstream_dots(graph, t):
                    if src in block_of:
                        edges.add((block_of[src] - start, b.index - start, d.role.value, pos,
                                   graph.tensor(t).short()))
    text = "|".join(b.fingerprint for b in blocks[start:stop]) + "#" + repr(sorted(edges))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _split_at_loops(groups: list[tuple[int, int]], loop_of: list[int | None]) -> list[tuple[int, int]]:
    """Cut groups where the loop around the blocks' forward dots changes: a scan body is a segment of its own
    (profiled once per iteration, counted `repeat` times)."""
    out = []
    for s, e in groups:
        start = s
        for i in range(s + 1, e + 1):
            if i == e or loop_of[i] != loop_of[start]:
                out.append((start, i))
                start = i
    return out


def find_segments(graph: OpGraph, blocks: tuple[ParallelBlock, ...]) -> tuple[Segment, ...]:
    groups = _scope_groups(blocks) or _tandem_groups([b.fingerprint for b in blocks])
    loop_of = [graph.operators[b.forward.op].loop for b in blocks]
    groups = _split_at_loops(groups, loop_of)
    kinds: dict[str, tuple[int, tuple[int, int]]] = {}
    out = []
    for i, (s, e) in enumerate(groups):
        fp = _segment_fingerprint(graph, blocks, s, e)
        if fp not in kinds:
            kinds[fp] = (len(kinds), (s, e))
        kind, first = kinds[fp]
        out.append(Segment(i, s, e, kind, first, fp, loop_of[s], graph.repeat(blocks[s].forward.op)))
    return tuple(out)
