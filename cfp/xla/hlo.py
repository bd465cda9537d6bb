"""Collectives that XLA actually inserted, parsed from the compiled (partitioned) HLO text.

Each collective gets its kind, per-device bytes, the mesh axes its replica groups span, and the cfp scope from
its metadata (`cfp_b<N>` inside block N, `cfp_reshard<N>` at the entry of block N), so the prediction of the
analysis can be checked instruction by instruction.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from cfp.dtypes import hlo_itemsize

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<kind>" +
                    "|".join(re.escape(k) for k in KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_SCOPE = re.compile(r"cfp_(b|reshard)(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int
    axes: tuple[int, ...]          # mesh axes spanned by a replica group
    block: int | None              # ParallelBlock from the metadata, if any
    reshard: bool                  # emitted at a block's entry (resharding), not inside it
    op_name: str


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * hlo_itemsize(dtype)
    return total


def _device_ids(text: str | None, n: int) -> np.ndarray:
    """Device order of a mesh-form replica group: none (0..n-1), an iota `[2,4]T(1,0)` or a list `0,4,1,5`."""
    if not text:
        return np.arange(n)
    m = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if m:
        ids = np.arange(n).reshape([int(x) for x in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(x) for x in m.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(x) for x in text.split(",") if x.strip()])


def _groups(line: str, num_devices: int) -> list[list[int]]:
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", line)
    if m:  # mesh form: mesh['axis_0'=2,'axis_1'=4] {'axis_0'} -> groups vary over the listed axes;
        # `device_ids=([2,4]T(1,0))` (an iota, maybe transposed) or `device_ids=(0,4,1,5,...)` orders the devices
        dims = re.findall(r"'?(\w+)'?=(\d+)", m.group(1))
        names = [d[0] for d in dims]
        sizes = [int(d[1]) for d in dims]
        over = [names.index(n) for n in re.findall(r"'?(\w+)'?", m.group(3)) if n in names]
        ids = _device_ids(m.group(2), math.prod(sizes)).reshape(sizes)
        keep = [i for i in range(len(sizes)) if i not in over]
        ids = ids.transpose(keep + over).reshape(-1, math.prod(sizes[i] for i in over) if over else 1)
        return ids.tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:  # iota tile form: [groups,size]<=[dims]T(perm)
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(g, s).tolist()
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if m:
        pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(0))
        return [[int(a), int(b)] for a, b in pairs]
    return [list(range(num_devices))]


def _axes_of(groups: list[list[int]], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    size = math.prod(mesh_shape)
    axes = set()
    for g in groups:
        coords = [np.unravel_index(d, mesh_shape) for d in g if d < size]
        for a in range(len(mesh_shape)):
            if len({c[a] for c in coords}) > 1:
                axes.add(a)
    return tuple(sorted(axes))


def parse_collectives(hlo_text: str, mesh_shape: tuple[int, ...]) -> tuple[Collective, ...]:
    out = []
    n = math.prod(mesh_shape)
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        op_name = ""
        mm = re.search(r'op_name="([^"]*)"', line)
        if mm:
            op_name = mm.group(1)
        scopes = _SCOPE.findall(op_name)
        block, reshard = None, False
        if scopes:
            kind, idx = scopes[-1]
            block, reshard = int(idx), kind == "reshard"
        out.append(Collective(m.group("kind"), _shape_bytes(m.group("shape")),
                              _axes_of(_groups(line, n), mesh_shape), block, reshard, op_name))
    return tuple(out)

