"""Sharding strategies of one tensor contraction (dot_general) on a 1-D or 2-D mesh.

A dot's iteration space has *loops*: batch (b), lhs-free (m), rhs-free (n) and contracting (k) dims. A strategy
maps each mesh axis to one loop; sharding a contracting loop leaves partial sums, i.e. an all-reduce on that
axis. The notation follows Alpa/CFP: `SS = SR x RS @ {0,1}` (output = lhs x rhs, one letter per tensor dim,
then the mesh axis of each sharded loop in order of appearance in lhs, then rhs).
"""
from __future__ import annotations

import dataclasses
import enum
import itertools

from cfp.ir.graph import DotDims


class LoopKind(enum.Enum):
    BATCH = "b"
    LHS_FREE = "m"
    RHS_FREE = "n"
    CONTRACT = "k"


@dataclasses.dataclass(frozen=True)
class Loop:
    """One iteration dim of a dot and where it appears (None where absent)."""

    kind: LoopKind
    size: int
    lhs_dim: int | None
    rhs_dim: int | None
    out_dim: int | None


def dot_loops(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dims: DotDims) -> tuple[Loop, ...]:
    """Loops in canonical order: batch, lhs free, rhs free, contracting (output order for the first three)."""
    loops: list[Loop] = []
    out = 0
    for lb, rb in zip(dims.lhs_batch, dims.rhs_batch):
        loops.append(Loop(LoopKind.BATCH, lhs_shape[lb], lb, rb, out))
        out += 1
    for d in range(len(lhs_shape)):
        if d not in dims.lhs_batch and d not in dims.lhs_contract:
            loops.append(Loop(LoopKind.LHS_FREE, lhs_shape[d], d, None, out))
            out += 1
    for d in range(len(rhs_shape)):
        if d not in dims.rhs_batch and d not in dims.rhs_contract:
            loops.append(Loop(LoopKind.RHS_FREE, rhs_shape[d], None, d, out))
            out += 1
    for lc, rc in zip(dims.lhs_contract, dims.rhs_contract):
        loops.append(Loop(LoopKind.CONTRACT, lhs_shape[lc], lc, rc, None))
    return tuple(loops)


@dataclasses.dataclass(frozen=True)
class DotStrategy:
    """Mesh axis i shards loop `loop_of_axis[i]` (a loop index of the dot, or None: unused axis)."""

    loop_of_axis: tuple[int | None, ...]

    def axes_of_loop(self, loop: int) -> tuple[int, ...]:
        return tuple(a for a, l in enumerate(self.loop_of_axis) if l == loop)

    def allreduce_axes(self, loops: tuple[Loop, ...]) -> tuple[int, ...]:
        return tuple(a for a, l in enumerate(self.loop_of_axis)
                     if l is not None and loops[l].kind is LoopKind.CONTRACT)

    def dim_axes(self, loops: tuple[Loop, ...], operand: str, rank: int) -> tuple[tuple[int, ...], ...]:
        """For each dim of `operand` ("lhs", "rhs" or "out"), the mesh axes sharding it."""
        attr = f"{operand}_dim"
        out: list[tuple[int, ...]] = [() for _ in range(rank)]
        for li, loop in enumerate(loops):
            d = getattr(loop, attr)
            if d is not None:
                out[d] = self.axes_of_loop(li)
        return tuple(out)

    def notation(self, loops: tuple[Loop, ...], lhs_rank: int, rhs_rank: int, out_rank: int) -> str:
        def letters(operand, rank):
            return "".join("S" if axes else "R" for axes in self.dim_axes(loops, operand, rank))
        order: list[int] = []
        for operand in ("lhs", "rhs"):
            for li in sorted((i for i, l in enumerate(loops) if getattr(l, f"{operand}_dim") is not None),
                             key=lambda i: getattr(loops[i], f"{operand}_dim")):
                if self.axes_of_loop(li) and li not in order:
                    order.append(li)
        axes = ",".join("".join(map(str, self.axes_of_loop(li))) for li in order)
        text = f"{letters('out', out_rank)} = {letters('lhs', lhs_rank)} x {letters('rhs', rhs_rank)} @ {{{axes}}}"
        ar = self.allreduce_axes(loops)
        if ar:
            text += f" (allreduce @ {','.join(map(str, ar))})"
        return text


def enumerate_strategies(loops: tuple[Loop, ...], mesh_shape: tuple[int, ...]) -> tuple[DotStrategy, ...]:
    """Every assignment of mesh axes (of size > 1) to loops that divides the loop sizes.

    Representative loops — per kind, the first (on a 2-D mesh the first two) whose size the smallest axis
    divides — keep the space small, as in Alpa's dot handler; the same loop may take several axes (e.g. data parallel over
    the whole 2-D mesh). Strategies where every axis shards the contracting loop are kept: they are valid,
    and the profiler, not the analysis, decides whether they are good.
    """
    active = [a for a, s in enumerate(mesh_shape) if s > 1]
    smallest = min((mesh_shape[a] for a in active), default=1)
    reps: list[int] = []
    per_kind: dict[LoopKind, int] = {}
    for li, loop in enumerate(loops):
        # up to one loop of each kind per mesh axis: on a 2-D mesh an attention dot can then shard the batch
        # on one axis and the heads (its second batch loop) on the other, as Megatron does
        if per_kind.get(loop.kind, 0) < max(1, len(active)) and loop.size % smallest == 0 and loop.size >= smallest:
            reps.append(li)
            per_kind[loop.kind] = per_kind.get(loop.kind, 0) + 1
    out = []
    for choice in itertools.product(reps, repeat=len(active)):
        per_loop: dict[int, int] = {}
        for a, li in zip(active, choice):
            per_loop[li] = per_loop.get(li, 1) * mesh_shape[a]
        if all(loops[li].size % n == 0 for li, n in per_loop.items()):
            assign: list[int | None] = [None] * len(mesh_shape)
            for a, li in zip(active, choice):
                assign[a] = li
            out.append(DotStrategy(tuple(assign)))
    if not out:  # nothing divides: the dot runs replicated (always valid)
        out.append(DotStrategy((None,) * len(mesh_shape)))
    return tuple(out)


def batch_loop_order(loops: tuple[Loop, ...], param_operand: str | None) -> list[int]:
    """Loops that may be a dot's batch, most likely first: its batch loops, then the free loops of the operand
    that is not a parameter (`param_operand`: "lhs", "rhs" or None when unknown, then the lhs's as an MLP's
    `x @ w` has it). Which operand is a parameter decides, not operand order: Equinox's vmapped `w @ x` puts
    the weight first, and its free loop is the layer's output features, not the batch."""
    free = LoopKind.RHS_FREE if param_operand == "lhs" else LoopKind.LHS_FREE
    return [i for kind in (LoopKind.BATCH, free) for i, l in enumerate(loops) if l.kind is kind]
