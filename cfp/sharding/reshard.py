"""Resharding paths XLA's SPMD partitioner takes efficiently.

XLA moves a tensor between two layouts with one all-gather, all-to-all, collective-permute or local slice when
it can; when it cannot it logs "Involuntary full rematerialization", gathers the whole tensor on every device
and slices it again. With jaxlib 0.12.0.1 that only happens when no dim is sharded in both layouts and the move
is more than one dim's axes going, whole, to one other dim that keeps them (`direct_ok` says when it cannot
happen): measured on every pair of layouts of rank-2 and rank-3 tensors on 2x4, 4x2 and 8 meshes and of rank-4
tensors on 2x4, under Shardy and under GSPMD alike (1,734 pairs each: XLA rematerialized 312, none missed, 168
flagged that XLA did manage; `benchmarks/reshard_rule.py`); `tests/test_reshard.py` re-checks the rank-2 pairs
on 2x4 against XLA under both. For a flagged move `reshard_path` finds intermediate layouts,
each one efficient step from the last: a path of single-axis gathers (all-gather), moves between dims
(all-to-all) and slices (free), cheapest by the bytes they move, shortened wherever a longer jump is still
efficient. Every flagged move so measured compiled without a rematerialization along its path.
"""
from __future__ import annotations

import functools
import heapq
import itertools
import math

from cfp.analysis.block_sharding import DimAxes

# (kind, per-device bytes of the larger buffer, devices in the group) of one collective
Step = tuple[str, float, int]


def all_layouts(rank: int, num_axes: int) -> list[DimAxes]:
    """Every layout of a rank-`rank` tensor on `num_axes` mesh axes (each axis on at most one dim, in any
    order), sorted: the space the resharding rule was checked on."""
    out = set()
    for dims in itertools.product(range(rank + 1), repeat=num_axes):
        for order in itertools.permutations(range(num_axes)):
            spec = [()] * rank
            for a in order:
                if dims[a] < rank:
                    spec[dims[a]] += (a,)
            out.add(tuple(spec))
    return sorted(out)


def _sharded_dims(spec: DimAxes) -> set[int]:
    return {d for d, axes in enumerate(spec) if axes}


def _axes(spec: DimAxes) -> set[int]:
    return {a for axes in spec for a in axes}


def direct_ok(src: DimAxes, dst: DimAxes) -> bool:
    """False when XLA may reshard `src` to `dst` by replicating and partitioning again: no dim is sharded in
    both, and the move is not one dim's axes going to one other dim that keeps all of them."""
    s, d = _sharded_dims(src), _sharded_dims(dst)
    if not s or not d or s & d:
        return True
    return len(s) == 1 and len(d) == 1 and _axes(src) <= _axes(dst)


def _size(axes, mesh_shape) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def _neighbours(spec: DimAxes, shape: tuple[int, ...], mesh_shape: tuple[int, ...], nbytes: float):
    """(next layout, its collective or None) for every single-axis step from `spec`."""
    shards = _size(_axes(spec), mesh_shape)
    free = [a for a in range(len(mesh_shape)) if a not in _axes(spec)]
    for d, axes in enumerate(spec):
        if axes:      # gather the dim's last axis
            a = axes[-1]
            out = tuple(x[:-1] if i == d else x for i, x in enumerate(spec))
            yield out, ("all-gather", nbytes / (shards // mesh_shape[a]), mesh_shape[a])
            for e in range(len(spec)):    # or move it to the end of another dim
                if e != d and shape[e] % (_size(spec[e], mesh_shape) * mesh_shape[a]) == 0:
                    moved = tuple(x[:-1] if i == d else x + (a,) if i == e else x for i, x in enumerate(spec))
                    yield moved, ("all-to-all", nbytes / shards, mesh_shape[a])
        for a in free:    # slice a free axis onto the dim
            if shape[d] % (_size(axes, mesh_shape) * mesh_shape[a]) == 0:
                yield tuple(x + (a,) if i == d else x for i, x in enumerate(spec)), None


def _step_weight(step: Step | None) -> float:
    if step is None:
        return 0.0
    kind, nbytes, n = step
    return (n - 1) / n * nbytes


@functools.lru_cache(maxsize=4096)
def _cheapest(src: DimAxes, dst: DimAxes, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
              ) -> tuple[tuple[DimAxes, ...], tuple[Step, ...]]:
    """Dijkstra over layouts by bytes moved (then steps): the layouts after `src` and their collectives, with
    bytes as fractions of the whole tensor."""
    nbytes = 1.0
    best = {src: (0.0, 0)}
    heap = [(0.0, 0, src, (), ())]
    while heap:
        cost, n, spec, path, steps = heapq.heappop(heap)
        if spec == dst:
            return path, steps
        if (cost, n) > best.get(spec, (math.inf, 0)):
            continue
        for nxt, step in _neighbours(spec, shape, mesh_shape, nbytes):
            key = (cost + _step_weight(step), n + 1)
            if key < best.get(nxt, (math.inf, 0)):
                best[nxt] = key
                heapq.heappush(heap, (*key, nxt, path + (nxt,), steps + ((step,) if step else ())))
    raise ValueError(f"no resharding path from {src} to {dst} for shape {shape} on mesh {mesh_shape}")


def _normal(spec: DimAxes, rank: int) -> DimAxes:
    spec = tuple(tuple(a) for a in spec)
    return spec + ((),) * (rank - len(spec))


def reshard_path(src: DimAxes, dst: DimAxes, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
                 ) -> tuple[DimAxes, ...]:
    """The layouts to constrain a tensor of `shape` to, in turn, to go from `src` to `dst` (the last is `dst`):
    just `dst` when XLA gets there efficiently itself, else a path of efficient steps."""
    src, dst = _normal(src, len(shape)), _normal(dst, len(shape))
    if src == dst or direct_ok(src, dst):
        return (dst,)
    path, _ = _cheapest(src, dst, tuple(shape), tuple(mesh_shape))
    out, at, here = [], 0, src
    while here != dst:     # jump as far along the path as one efficient step reaches
        at = max(i for i in range(at, len(path)) if direct_ok(here, path[i]) or i == at)
        here = path[at]
        out.append(here)
        at += 1
    return tuple(out)


def reshard_steps(src: DimAxes, dst: DimAxes, shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                  nbytes: int) -> tuple[Step, ...]:
    """The collectives of the cheapest single-axis path from `src` to `dst` for a tensor of `nbytes` bytes
    (all-gathers and all-to-alls with their per-device bytes and group sizes), the resharding's price."""
    src, dst = _normal(src, len(shape)), _normal(dst, len(shape))
    if src == dst:
        return ()
    steps = _cheapest(src, dst, tuple(shape), tuple(mesh_shape))[1]
    return tuple((kind, frac * nbytes, n) for kind, frac, n in steps)
