"""HexiScale's two graph-partitioning phases with METIS (pymetis).

The graph: devices are vertices weighted by their achievable compute; links are edges weighted by
bandwidth (every pair inside a machine; across machines, devices with the same local index, which
keeps the graph sparse at 1024 devices while every machine pair stays connected). Phase 1 cuts the
cluster into pipelines of balanced compute, cutting as little bandwidth as possible, so fast links stay
inside a pipeline. Phase 2 cuts each pipeline into stages (equal device counts per TP group), which the
bandwidth weights keep inside machines; a part that still spans machines or has the wrong size is
re-cut machine by machine. Stages are ordered greedily so neighbours share the most bandwidth.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Sequence

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
    rank = {}
    for m, vs in local.items():
        for i, v in enumerate(vs):
            rank[v] = i
    by_rank: dict[int, list[int]] = defaultdict(list)
    for v in range(len(devices)):
        by_rank[rank[v]].append(v)
    unit = 1e8  # edge weight in 0.1 GB/s
    xadj, adjncy, ew = [0], [], []
    for v in range(len(devices)):
        for u in local[machine[v]]:
            if u != v:
                adjncy.append(u)
                ew.append(max(1, int(round(cluster.machines[machine[v]].intra_bandwidth / unit))))
        for u in by_rank[rank[v]]:
            if machine[u] != machine[v]:
                adjncy.append(u)
                ew.append(max(1, int(round(cluster.inter_bandwidth / unit))))
        xadj.append(len(adjncy))
    vw = [max(1, int(round(vweight(devs[d])))) for d in devices]
    return xadj, adjncy, vw, ew


def _parts(n: int, devices: Sequence[int], membership: Sequence[int]) -> list[list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for d, p in zip(devices, membership):
        groups[p].append(d)
    return [sorted(groups[p]) for p in sorted(groups) if groups[p]][:n]


def split_pipelines(cluster: Cluster, k: int, rate) -> list[list[int]]:
    """Phase 1: `k` groups of devices (fewer if METIS leaves a part empty), balanced in `rate`."""
    devices = list(range(cluster.num_devices))
    if k <= 1:
        return [devices]
    if k >= len(devices):
        return [[d] for d in devices]
    scale = 100.0 / min(rate(d) for d in cluster.devices)
    xadj, adjncy, vw, ew = _graph(cluster, devices, lambda d: rate(d) * scale)
    _, membership = pymetis.part_graph(k, pymetis.CSRAdjacency(xadj, adjncy), vweights=vw, eweights=ew,
                                       options=pymetis.Options(**_OPTIONS))
    return sorted(_parts(k, devices, membership), key=lambda g: g[0])


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


def split_stages(cluster: Cluster, devices: Sequence[int], tp_of, heads: int) -> list[list[int]]:
    """Phase 2: the pipeline's devices cut into TP groups (one machine each), METIS first."""
    fallback = machine_groups(cluster, devices, tp_of, heads)
    n = len(fallback)
    if n <= 1 or len(set(len(g) for g in fallback)) != 1:
        return fallback  # unequal group sizes: METIS' equal-weight parts cannot express them
    devs = cluster.devices
    machines = {devs[d].machine for d in devices}
    if all(cluster.machines[m].intra_bandwidth >= cluster.inter_bandwidth for m in machines):
        # every machine's share is whole TP groups and its links are the fastest: machine-aligned groups
        # cut only what any equal split must cut, so they are a min-cut partition; METIS has no choice
        return fallback
    xadj, adjncy, vw, ew = _graph(cluster, devices, lambda d: 1)
    _, membership = pymetis.part_graph(n, pymetis.CSRAdjacency(xadj, adjncy), vweights=vw, eweights=ew,
                                       options=pymetis.Options(**_OPTIONS))
    parts = _parts(n, devices, membership)
    size = len(fallback[0])
    ok = len(parts) == n and all(len(p) == size and len({devs[d].machine for d in p}) == 1 for p in parts)
    return parts if ok else fallback


def order_stages(cluster: Cluster, groups: list[list[int]]) -> list[list[int]]:
    """Greedy chain: start in the machine holding most of the pipeline's groups, then always append the
    group with the most bandwidth to the chain's end (ties: same device type, then lowest id)."""
    devs = cluster.devices
    queues: dict[int, list[list[int]]] = defaultdict(list)
    for g in sorted(groups, key=lambda g: g[0]):
        queues[devs[g[0]].machine].append(g)
    # groups of one machine share links and device type, so only each machine's lowest group competes
    start = min(queues, key=lambda m: (-len(queues[m]), queues[m][0][0]))
    chain = [queues[start].pop(0)]
    end = start
    while any(queues.values()):
        gpu = cluster.machines[end].gpu.name
        nxt = min((m for m in queues if queues[m]),
                  key=lambda m: (-cluster.link(end, m), cluster.machines[m].gpu.name != gpu, m, queues[m][0][0]))
        chain.append(queues[nxt].pop(0))
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
