"""Marked dims of a traced part of a layered model: which dims of every tensor carry the batch rows, and which
are split over `tp` tensor-parallel devices, walked forward through the program's dim links
(`cfp.analysis.dimflow`) from the marks of its inputs.

A dot whose contraction is split leaves partial sums: an all-reduce of its output (Megatron's row-parallel
projection), after which the output is whole. Otherwise one split of the dot carries over to its output, in
the order batch, rhs free, lhs free dims. With `guess` (a model without logical names), a dot whose operands are
not split and one of which carries no rows (a weight) splits that operand's free loop at its major dim the
degree divides (column-parallel; a [H, heads, D] kernel splits its heads), and a dot that contracts a split
splits its weight's matching dim (row-parallel); a weight added or multiplied into a split result (a bias) splits
alike; a guess whose split would reach the part's results (the activation between layers) is withdrawn. That
reproduces Megatron's MLP and attention; it is a guess
from shapes, which named parameters replace.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Optional

from cfp.analysis.dimflow import links
from cfp.ir.graph import OpGraph, Operator

Marks = dict[int, frozenset[int]]


@dataclasses.dataclass(frozen=True)
class DotSplit:
    """A dot's loops (batch, lhs free (m), rhs free (n), contraction (k) sizes) and which one its marks split
    (`split`: "b", "m", "n", "k" or None)."""
    op: int
    sizes: tuple[int, int, int, int]
    split: Optional[str]
    out_bytes: int


def dot_loops(op: Operator, graph: OpGraph) -> tuple[list[int], list[int], list[int], list[int]]:
    """(batch, lhs free, rhs free, lhs contraction) dims of a dot, as dims of its lhs (rhs free: of its rhs)."""
    d = op.dot
    lhs, rhs = (graph.tensor(t) for t in op.inputs[:2])
    lfree = [i for i in range(len(lhs.shape)) if i not in d.lhs_contract and i not in d.lhs_batch]
    rfree = [i for i in range(len(rhs.shape)) if i not in d.rhs_contract and i not in d.rhs_batch]
    return list(d.lhs_batch), lfree, rfree, list(d.lhs_contract)


def dot_sizes(op: Operator, graph: OpGraph) -> tuple[int, int, int, int]:
    lhs, rhs = (graph.tensor(t) for t in op.inputs[:2])
    b, lf, rf, k = dot_loops(op, graph)
    return (math.prod(lhs.shape[i] for i in b), math.prod(lhs.shape[i] for i in lf),
            math.prod(rhs.shape[i] for i in rf), math.prod(lhs.shape[i] for i in k))


class _Walk:
    def __init__(self, graph: OpGraph, seeds: Mapping[int, Iterable[int]], divisor: int,
                 rows: Optional[Marks], guess: bool, forbidden: frozenset = frozenset()):
        self.g, self.divisor, self.rows, self.guess = graph, divisor, rows, guess
        self.forbidden = forbidden                      # dots a guess may not split
        self.marks: Marks = {t: frozenset(d) for t, d in seeds.items() if d}
        self.dots: list[DotSplit] = []
        self.guessed: dict[int, frozenset[int]] = {}    # graph inputs split by a guess: tensor -> dims
        self.guessed_dots: set[int] = set()

    def of(self, t: Optional[int]) -> frozenset[int]:
        return self.marks.get(t, frozenset()) if t is not None else frozenset()

    def mark(self, t: int, dim: int) -> None:
        if self.g.tensor(t).shape[dim] % self.divisor == 0:
            self.marks[t] = self.of(t) | {dim}

    def run(self) -> None:
        for op in self.g.operators:
            if op.is_dot:
                self._dot(op)
                continue
            outs = {t for t in op.outputs if t is not None}
            found = [k for k in links(op, self.g) if k[2] in outs]
            for ta, da, tb, db in found:
                if da in self.of(ta):
                    self.mark(tb, db)
            if self.guess:
                self._weights_alike(found)

    def _weights_alike(self, found) -> None:
        """A guessing walk: a weight combined elementwise with a split result (a column-parallel bias) is split
        alike."""
        for ta, da, tb, db in found:
            if db in self.of(tb) and da not in self.of(ta) and not (self.rows or {}).get(ta):
                self._note(ta, da)

    def _dot(self, op: Operator) -> None:
        lhs, rhs = op.inputs[:2]
        if lhs is None or rhs is None:
            return
        d = op.dot
        b, lf, rf, k = dot_loops(op, self.g)
        out = op.outputs[0]
        lm, rm = self.of(lhs), self.of(rhs)
        if self.guess and not (lm or rm) and op.index not in self.forbidden:
            self._guess(op, lhs, rhs, lf, rf)
            self.guessed_dots.add(op.index)
            lm, rm = self.of(lhs), self.of(rhs)
        nb = len(b)
        split = None
        if any(c in lm for c in d.lhs_contract) or any(c in rm for c in d.rhs_contract):
            split = "k"
            if self.guess:
                self._row_parallel(op, lm, rm)
        elif any(x in lm for x in d.lhs_batch) or any(x in rm for x in d.rhs_batch):
            split = "b"
            for i, (x, y) in enumerate(zip(d.lhs_batch, d.rhs_batch)):
                if x in lm or y in rm:
                    self.mark(out, i)
        elif any(x in rm for x in rf):
            split = "n"
            for i, x in enumerate(rf):
                if x in rm:
                    self.mark(out, nb + len(lf) + i)
        elif any(x in lm for x in lf):
            split = "m"
            for i, x in enumerate(lf):
                if x in lm:
                    self.mark(out, nb + i)
        self.dots.append(DotSplit(op.index, dot_sizes(op, self.g), split, self.g.tensor(out).nbytes))

    def _guess(self, op: Operator, lhs: int, rhs: int, lf: list[int], rf: list[int]) -> None:
        """Column-parallel: the weight operand (no rows) splits its largest free dim the degree divides."""
        for t, free in ((rhs, rf), (lhs, lf)):
            if self.rows is not None and self.rows.get(t):
                continue
            shape = self.g.tensor(t).shape
            # the free dims are one loop of the GEMM: split at its major dim (a [H, heads, D] kernel: heads)
            cands = [x for x in free if shape[x] % self.divisor == 0]
            if cands:
                self.mark(t, cands[0])
                self._note(t, cands[0])
            return

    def _note(self, t: int, dim: int) -> None:
        src = source_dim(self.g, t, dim)
        if src is not None:
            self.guessed[src[0]] = self.guessed.get(src[0], frozenset()) | {src[1]}

    def _row_parallel(self, op: Operator, lm: frozenset, rm: frozenset) -> None:
        """A guessing walk's contracted split: the weight operand is split on the same contraction dim."""
        lhs, rhs = op.inputs[:2]
        d = op.dot
        for lc, rc in zip(d.lhs_contract, d.rhs_contract):
            for t, dim, other in ((rhs, rc, lc in lm), (lhs, lc, rc in rm)):
                if other and dim not in self.of(t) and not (self.rows or {}).get(t):
                    self.mark(t, dim)
                    self._note(t, dim)


def source_dim(graph: OpGraph, t: int, dim: int) -> Optional[tuple[int, int]]:
    """(graph input, its dim) that dim `dim` of tensor `t` comes from through single-operand operators (a
    weight's casts, reshapes, transposes); None when it comes from elsewhere."""
    prod = graph.producer
    inputs = set(graph.inputs)
    for _ in range(64):
        if t in inputs:
            return t, dim
        i = prod.get(t)
        if i is None:
            return None
        op = graph.operators[i]
        ins = [x for x in op.inputs if x is not None]
        if op.is_dot or len(ins) != 1:
            return None
        found = [(ta, da) for ta, da, tb, db in links(op, graph) if tb == t and db == dim]
        if not found:
            return None
        t, dim = found[0]
    return None


@dataclasses.dataclass(frozen=True)
class Walked:
    """The marks of one walk: per tensor its marked dims, per dot its split, and (a guessing walk) the
    graph inputs it split."""
    marks: Marks
    dots: tuple[DotSplit, ...]
    guessed: Mapping[int, frozenset[int]]

    def split(self, t: Optional[int]) -> bool:
        return t is not None and bool(self.marks.get(t))


def walk(graph: OpGraph, seeds: Mapping[int, Iterable[int]], divisor: int = 1, rows: Optional[Marks] = None,
         guess: bool = False) -> Walked:
    """Marks of every tensor from the `seeds` (tensor -> dims), kept only on dims `divisor` divides; `rows`
    (a rows walk's marks) and `guess` as in the module doc. A guessing walk keeps the part's results whole (the
    activation between layers and stages is not split in Megatron's layout): a guessed split that reaches them
    is withdrawn, latest first, and the walk redone."""
    forbidden: frozenset = frozenset()
    while True:
        w = _Walk(graph, seeds, divisor, rows, guess, forbidden)
        w.run()
        culprits = _reaching_outputs(graph, w) & w.guessed_dots if guess else set()
        if not culprits:
            return Walked(w.marks, tuple(w.dots), dict(w.guessed))
        forbidden |= {max(culprits)}


def _reaching_outputs(graph: OpGraph, w: _Walk) -> set[int]:
    """Dots whose split result reaches a result of the part through split tensors."""
    prod = graph.producer
    stack = [t for t in graph.outputs if t is not None and w.of(t)]
    seen, dots = set(stack), set()
    while stack:
        i = prod.get(stack.pop())
        if i is None:
            continue
        op = graph.operators[i]
        if op.is_dot:
            dots.add(i)
            continue
        for t in op.inputs:
            if t is not None and t not in seen and w.of(t):
                seen.add(t)
                stack.append(t)
    return dots
