"""Layouts `cfp plan --compare` sets beside the planner's, all estimated with the same cost model:
a homogeneous Megatron-style layout and a speed-proportional greedy heuristic."""
from __future__ import annotations

from typing import Optional

from cfp.layout import Layout, Pipeline, Stage
from cfp.planner.build import build_layout, stage_layouts
from cfp.planner.costmodel import CostModel, Estimate
from cfp.planner.metis import machine_groups
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import pipeline_counts


def _best(cm: CostModel, layouts) -> Optional[tuple[Layout, Estimate]]:
    best = None
    for lay in layouts:
        if lay is None:
            continue
        e = cm.estimate(lay)
        if e.fits and (best is None or e.objective < best[1].objective):
            best = (lay, e)
    return best


def _megatron(cm: CostModel, t: int, p: int, d: int, batch: int, mb: int) -> Optional[Layout]:
    """Devices packed in id order: pipeline j takes the next t*p devices, stage s the next t; equal
    layers (the first L % p stages one more) and equal batches."""
    L = cm.model.num_layers
    if p > L or batch % d or (batch // d) % mb:
        return None
    devs = cm.cluster.devices
    pipes, nxt = [], 0
    for _ in range(d):
        stages = []
        for s in range(p):
            ids = tuple(range(nxt, nxt + t))
            nxt += t
            if len({devs[i].machine for i in ids}) != 1:
                return None  # a TP group across machines: not a Megatron layout
            stages.append(Stage(ids, L // p + (1 if s < L % p else 0), devs[ids[0]].machine))
        pipes.append(Pipeline(tuple(stages), batch // d, batch // d // mb))
    return Layout(tuple(pipes))


def megatron_layout(cm: CostModel, options: PlannerOptions) -> Optional[tuple[Layout, Estimate]]:
    """The best uniform (TP, PP, DP) over all devices, as a Megatron user would tune it."""
    n, heads = cm.cluster.num_devices, cm.model.tp_divisor
    cands = []
    for t in (1, 2, 4, 8, 16):
        if n % t or heads % t:
            continue
        for p in range(1, n // t + 1):
            if (n // t) % p:
                continue
            for mb in options.micro_batch_sizes:
                cands.append(_megatron(cm, t, p, n // t // p, options.global_batch_size, mb))
    return _best(cm, cands)


def greedy_layout(cm: CostModel, options: PlannerOptions) -> Optional[tuple[Layout, Estimate]]:
    """Speed-proportional greedy: each machine's devices in TP groups of up to 8, groups dealt fastest
    first to the pipeline with the least compute, stages in machine order, layers and batch by speed."""
    cl, heads = cm.cluster, cm.model.tp_divisor
    groups = machine_groups(cl, range(cl.num_devices), lambda m: min(8, cl.machines[m].count), heads)
    speed = lambda g: len(g) * cm.rate(cl.devices[g[0]].machine)
    groups.sort(key=lambda g: (-speed(g), g[0]))
    cands = []
    for k in pipeline_counts(cl, options, cm.model.num_layers):
        if k > len(groups):
            break
        load = [0.0] * k
        pipes: list[list[list[int]]] = [[] for _ in range(k)]
        for g in groups:
            j = min(range(k), key=lambda i: (load[i], i))
            pipes[j].append(g)
            load[j] += speed(g)
        stages = [[stage_layouts(cm, sorted(p, key=lambda g: g[0]))] for p in pipes]
        for mb in options.micro_batch_sizes:
            cands.append(build_layout(cm, stages, options.global_batch_size, mb))
    return _best(cm, cands)
