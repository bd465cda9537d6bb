"""HexiScale's two graph-partitioning phases with METIS (pymetis).

The graph: devices are vertices weighted by their achievable compute; links are edges weighted by
bandwidth (every pair inside a machine; across machines, devices with the same local index, which
keeps the graph sparse at 1024 devices while every machine pair stays connected). Phase 1 cuts the
cluster into pipelines of balanced compute, cutting as little bandwidth as possible, so fast links stay
inside a pipeline. Phase 2 cuts each pipeline into stages: TP groups of one degree per device type, and
METIS' cut into as many stages of balanced compute (re-cut at machine borders and into power-of-two
groups), both offered to the cost model (`split_stages`). Stages are ordered greedily so neighbours
share the most bandwidth; with few machines every order of the machines is a candidate.
"""
from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from typing import Sequence

import numpy as np
import pymetis

from cfp.planner.cluster import Cluster

_OPTIONS = dict(seed=0, ufactor=30)  # fixed seed: the same input gives the same partition


def _graph(cluster: Cluster, devices: Sequence[int], vweight) -> tuple[list[int], list[int], list[int], list[int]]:
    """CSR adjacency (xadj, adjncy), vertex weights and edge weights over `devices`."""
    devs = cluster.devices
    machine = [devs[d].machine for d in devices]
    local: dict[int, list[int]] = defaultdict(list)
    for v, m in enumerate(machine):
        local[m].append(v)
    rank = [0] * len(devices)
    by_rank: dict[int, list[int]] = defaultdict(list)
    for vs in local.values():
        for i, v in enumerate(vs):
            rank[v] = i
            by_rank[i].append(v)
    unit = 1e8  # edge weight in 0.1 GB/s
    intra = {m: max(1, int(round(cluster.machines[m].intra_bandwidth / unit))) for m in local}
    inter = max(1, int(round(cluster.inter_bandwidth / unit)))
    xadj, adjncy, ew = [0], [], []
    for v in range(len(devices)):
        mv = machine[v]
        same = [u for u in local[mv] if u != v]
        other = [u for u in by_rank[rank[v]] if machine[u] != mv]
        adjncy += same
        adjncy += other
        ew += [intra[mv]] * len(same) + [inter] * len(other)
        xadj.append(len(adjncy))
    vw = [max(1, int(round(vweight(devs[d])))) for d in devices]
    return xadj, adjncy, vw, ew


@functools.lru_cache(maxsize=4096)
def _metis(parts: int, xadj: tuple, adjncy: tuple, vw: tuple, ew: tuple) -> tuple[int, ...]:
    """METIS' membership of a graph (memoised: with its fixed seed METIS gives the same cut of the same
    graph, and pipelines of like machines give the same graph, which planning at scale cuts hundreds of
    times)."""
    graph = pymetis.CSRAdjacency(np.asarray(xadj, np.int32), np.asarray(adjncy, np.int32))
    _, membership = pymetis.part_graph(parts, graph, vweights=np.asarray(vw, np.int32),
                                       eweights=np.asarray(ew, np.int32), options=pymetis.Options(**_OPTIONS))
    return tuple(membership)


def _cut(parts: int, graph: tuple[list[int], list[int], list[int], list[int]]) -> tuple[int, ...]:
    return _metis(parts, *(tuple(x) for x in graph))


def _parts(n: int, devices: Sequence[int], membership: Sequence[int]) -> list[list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for d, p in zip(devices, membership):
        groups[p].append(d)
    return [sorted(groups[p]) for p in sorted(groups) if groups[p]][:n]


def cluster_graph(cluster: Cluster, rate) -> tuple[tuple[int, ...], ...]:
    """Phase 1's graph of the whole cluster, vertices weighted by `rate` (`_graph`'s lists as tuples): the same
    for every pipeline count, so a search builds it once for `split_pipelines`."""
    scale = 100.0 / min(rate(d) for d in cluster.devices)
    return tuple(tuple(x) for x in _graph(cluster, range(cluster.num_devices), lambda d: rate(d) * scale))


def phase1_edges(cluster: Cluster) -> int:
    """Entries of phase 1's adjacency (`cluster_graph`: each edge once per end), counted without building it."""
    counts = [m.count for m in cluster.machines]
    deeper = [sum(c > i for c in counts) for i in range(max(counts))]    # machines with a device of local index i
    return sum(c * (c - 1) + sum(deeper[i] - 1 for i in range(c)) for c in counts)


def split_pipelines(cluster: Cluster, k: int, rate, graph: tuple | None = None) -> list[list[int]]:
    """Phase 1: `k` groups of devices (fewer if METIS leaves a part empty), balanced in `rate`; `graph`:
    `cluster_graph(cluster, rate)` if the caller has it."""
    devices = list(range(cluster.num_devices))
    if k <= 1:
        return [devices]
    if k >= len(devices):
        return [[d] for d in devices]
    membership = _metis(k, *(graph or cluster_graph(cluster, rate)))
    return sorted(_parts(k, devices, membership), key=lambda g: g[0])


def split_by_type(cluster: Cluster, k: int) -> list[list[int]]:
    """Phase 1's alternative cut: each device type's devices (machine-major) dealt in `k` contiguous,
    near-equal slices, one per pipeline, so every pipeline gets the same share of each type (data-parallel
    replicas of one heterogeneous pipeline), keeping machines whole where the counts allow. METIS'
    min-cut keeps fast-linked machines together instead, which this cut can beat when pipelines of
    equal shares balance better. Empty pipelines are dropped."""
    parts: list[list[int]] = [[] for _ in range(k)]
    by_type: dict[str, list[int]] = defaultdict(list)
    for d in cluster.devices:
        by_type[cluster.machines[d.machine].gpu.name].append(d.id)
    for name in sorted(by_type):
        ds = by_type[name]
        for p in range(k):
            parts[p] += ds[p * len(ds) // k:(p + 1) * len(ds) // k]
    return sorted((sorted(p) for p in parts if p), key=lambda g: g[0])


def machine_groups(cluster: Cluster, devices: Sequence[int], tp_of, heads: int) -> list[list[int]]:
    """Cut each machine's share of `devices` into TP groups of its degree; a remainder becomes smaller
    groups of power-of-two sizes that divide `heads`."""
    by_machine: dict[int, list[int]] = defaultdict(list)
    for d in sorted(devices):
        by_machine[cluster.devices[d].machine].append(d)
    out = []
    for m in sorted(by_machine):
        ds, t = by_machine[m], tp_of(m)
        i = 0
        while i < len(ds):
            size = t
            while size > 1 and (size > len(ds) - i or heads % size):
                size //= 2
            out.append(ds[i:i + size])
            i += size
    return out


def _power_pieces(ds: list[int], heads: int) -> list[list[int]]:
    """`ds` cut into groups of power-of-two sizes dividing `heads`, largest first."""
    out, i = [], 0
    while i < len(ds):
        size = 1
        while size * 2 <= len(ds) - i and heads % (size * 2) == 0:
            size *= 2
        out.append(ds[i:i + size])
        i += size
    return out


def balanced_stages(cluster: Cluster, devices: Sequence[int], parts: int, rate, heads: int) -> list[list[int]]:
    """Phase 2 with METIS: the pipeline's devices cut into `parts` stages of balanced compute (vertex
    weight: the device's rate), cutting as little bandwidth as possible; a part is then cut at machine
    borders (TP stays inside a machine) and into power-of-two groups that divide `heads`. Unlike
    `machine_groups` (one TP degree per device type) the group sizes follow compute: slower devices
    get wider groups."""
    devices = sorted(devices)
    if parts <= 1 or len(devices) <= 1:
        membership = [0] * len(devices)
    elif 2 * parts > len(devices):
        # parts of one or two devices: METIS' recursive bisection runs out of vertices on such cuts
        # of weighted graphs (it reports an error and returns an arbitrary membership); one device
        # per part is the balanced cut there
        membership = list(range(len(devices)))
    else:
        scale = 100.0 / min(rate(cluster.devices[d]) for d in devices)
        membership = _cut(parts, _graph(cluster, devices, lambda d: rate(d) * scale))
    out = []
    for part in _parts(len(devices), devices, membership):
        by_machine: dict[int, list[int]] = defaultdict(list)
        for d in part:
            by_machine[cluster.devices[d].machine].append(d)
        for m in sorted(by_machine):
            out.extend(_power_pieces(by_machine[m], heads))
    return sorted(out, key=lambda g: g[0])


def split_stages(cluster: Cluster, typed: list[list[int]], balanced: list[list[int]]) -> list[list[list[int]]]:
    """Phase 2's candidate cuts of one pipeline into TP groups: one TP degree per device type (`typed`,
    from `machine_groups`) and METIS' compute-balanced cut into as many stages (`balanced`, from
    `balanced_stages`) where its group sizes differ. The cost model chooses (`build.build_layout`).

    A METIS cut into parts of *equal device count* would add nothing: every group must stay inside one
    machine and a machine's devices are interchangeable (one device type, one intra-machine
    bandwidth), so any such cut equals `machine_groups` up to relabelling devices, which no estimate
    sees. Balancing compute instead of device counts is what lets METIS choose other group sizes."""
    shape = lambda gs: sorted((cluster.devices[g[0]].machine, len(g)) for g in gs)
    return [typed] if shape(balanced) == shape(typed) else [typed, balanced]


def size_cuts(count: int, heads: int) -> list[tuple[int, ...]]:
    """Multisets (descending) of power-of-two TP group sizes dividing `heads` that sum to `count`: the
    ways one machine's devices can be cut into TP groups."""
    sizes = [t for t in (16, 8, 4, 2, 1) if t <= count and heads % t == 0]

    def rec(left: int, top: int):
        if left == 0:
            yield ()
            return
        for t in sizes:
            if t <= min(left, top):
                for rest in rec(left - t, t):
                    yield (t,) + rest
    return list(rec(count, count))


def size_orders(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """The distinct orders of a multiset of group sizes (largest first at each position)."""
    left: dict[int, int] = defaultdict(int)
    for t in sizes:
        left[t] += 1
    out: list[tuple[int, ...]] = []

    def rec(prefix: tuple[int, ...]):
        if len(prefix) == len(sizes):
            out.append(prefix)
            return
        for t in sorted(left, reverse=True):
            if left[t]:
                left[t] -= 1
                rec(prefix + (t,))
                left[t] += 1
    rec(())
    return out


def order_stages(cluster: Cluster, groups: list[list[int]]) -> list[list[int]]:
    """Greedy chain: start in the machine holding most of the pipeline's groups, then always append the
    group with the most bandwidth to the chain's end (ties: same device type, then lowest id)."""
    devs, machines = cluster.devices, cluster.machines
    queues: dict[int, list[list[int]]] = defaultdict(list)
    for g in sorted(groups, key=lambda g: g[0]):
        queues[devs[g[0]].machine].append(g)
    # groups of one machine share links and device type, so only each machine's lowest group competes
    start = min(queues, key=lambda m: (-len(queues[m]), queues[m][0][0]))
    live = sorted(queues)                               # machines with groups left
    by_gpu: dict[str, list[int]] = defaultdict(list)
    for m in live:
        by_gpu[machines[m].gpu.name].append(m)
    left = {m: len(q) for m, q in queues.items()}

    def take(m: int) -> list[int]:
        left[m] -= 1
        if not left[m]:
            live.remove(m)
            by_gpu[machines[m].gpu.name].remove(m)
        return queues[m][len(queues[m]) - left[m] - 1]

    chain, end = [take(start)], start
    while live:
        if left[end] and machines[end].intra_bandwidth > cluster.inter_bandwidth:
            chain.append(take(end))     # its own link beats every other machine's: the min below, sooner
            continue
        gpu = machines[end].gpu.name
        # every other machine is one inter-machine link away: the best of them is the lowest of the same
        # type, else the lowest; the chain's own machine competes with its intra-machine link
        cands = [m for m in (next((m for m in by_gpu[gpu] if m != end), None),
                             next((m for m in live if m != end), None)) if m is not None]
        if left[end]:
            cands.append(end)
        nxt = min(cands, key=lambda m: (-cluster.link(end, m), machines[m].gpu.name != gpu, m,
                                        queues[m][len(queues[m]) - left[m]][0]))
        chain.append(take(nxt))
        end = nxt
    return chain


def stage_orders(cluster: Cluster, groups: list[list[int]], max_blocks: int = 4) -> list[list[list[int]]]:
    """Candidate stage orders, the greedy chain first: with at most `max_blocks` machines every order of
    the machines (each machine's stages together, so neighbours keep the same links), else the chain and
    its reverse. Which machine holds the embedding and which the head changes memory and time, so the
    cost model picks among them."""
    chain = order_stages(cluster, groups)
    devs = cluster.devices
    blocks: dict[int, list[list[int]]] = {}
    for g in chain:
        blocks.setdefault(devs[g[0]].machine, []).append(g)
    keys = list(blocks)
    if len(keys) > max_blocks:
        return [chain, chain[::-1]] if len(chain) > 1 else [chain]
    return [[g for m in perm for g in blocks[m]] for perm in itertools.permutations(keys)]
