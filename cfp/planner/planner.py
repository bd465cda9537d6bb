"""The heterogeneous-cluster planner (HexiScale): pipelines by METIS, stages by METIS, layers by stage
speed under memory, batch by pipeline throughput, then refinement; searched over the number of
pipelines and the TP degree of each device type."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from cfp.errors import InfeasibleError
from cfp.planner.build import build_layout, stage_layouts
from cfp.planner.cluster import Cluster
from cfp.planner.costmodel import ClusterLayout, CostModel, Estimate
from cfp.planner.options import PlannerOptions
from cfp.planner.partition import split_pipelines, split_stages, stage_orders
from cfp.planner.refine import refine


@dataclass(frozen=True)
class PlannerResult:
    layout: ClusterLayout
    estimate: Estimate
    candidates: int       # (pipelines, TP, micro-batch) combinations estimated
    seconds: float        # measured planning time


def tp_choices(cluster: Cluster, heads: int) -> dict[str, list[int]]:
    """Per device type, the TP degrees that fit in its largest machine and divide `heads`."""
    out: dict[str, list[int]] = {}
    for m in cluster.machines:
        top = max(m.count, max(out.get(m.gpu.name, [1])))
        out[m.gpu.name] = [t for t in (1, 2, 4, 8, 16) if t <= top and heads % t == 0]
    return out


def pipeline_counts(cluster: Cluster, options: PlannerOptions, num_layers: int) -> list[int]:
    """Pipelines to try: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to a quarter of the devices (METIS leaves
    parts empty beyond), the batch and the cap."""
    n = cluster.num_devices
    top = min(n if n <= 16 else n // 4, options.global_batch_size // options.micro_batch_sizes[0],
              options.max_pipelines or n)
    ks = sorted({b * 2 ** j for b in (1, 3) for j in range(12) if b * 2 ** j <= top})
    # every pipeline needs at most one stage per layer: with the widest TP, n/k/tp_max <= layers
    widest = max(m.count for m in cluster.machines)
    return [k for k in ks if n / k / widest <= num_layers] or [top]


class _Search:
    def __init__(self, cm: CostModel, options: PlannerOptions):
        self.cm, self.options = cm, options
        self.rate = lambda d: cm.rate(d.machine)
        self._phase1: dict[int, list[list[int]]] = {}
        self._phase2: dict[tuple, list[list[int]]] = {}
        self.count = 0

    def pipelines(self, k: int) -> list[list[int]]:
        if k not in self._phase1:
            self._phase1[k] = split_pipelines(self.cm.cluster, k, self.rate)
        return self._phase1[k]

    def stages(self, devices: list[int], tp_of) -> list[list[list[int]]]:
        """Phase 2 and the candidate stage orders of one pipeline (cached: pipelines recur across TP maps)."""
        cl = self.cm.cluster
        key = (tuple(devices), tuple(tp_of(m) for m in sorted({cl.devices[d].machine for d in devices})))
        if key not in self._phase2:
            self._phase2[key] = stage_orders(cl, split_stages(cl, devices, tp_of, self.cm.config.num_heads))
        return self._phase2[key]

    def evaluate(self, k: int, tp: dict[str, int]) -> tuple[Optional[ClusterLayout], float]:
        cl, heads = self.cm.cluster, self.cm.config.num_heads
        tp_of = lambda m: tp[cl.machines[m].gpu.name]
        pipes = [[stage_layouts(self.cm, o) for o in self.stages(g, tp_of)] for g in self.pipelines(k)]
        best, best_t = None, math.inf
        for mb in self.options.micro_batch_sizes:
            layout = build_layout(self.cm, pipes, self.options.global_batch_size, mb)
            if layout is None:
                continue
            self.count += 1
            t = self.cm.estimate(layout).objective
            if t < best_t:
                best, best_t = layout, t
        return best, best_t


def find_layout(cluster: Cluster, config, options: PlannerOptions,
                progress: Optional[Callable[[int, int], None]] = None) -> PlannerResult:
    """The best layout the planner finds for `config` on `cluster` (deterministic)."""
    t0 = time.perf_counter()
    cm = CostModel(config, cluster, options.schedule)
    search = _Search(cm, options)
    choices = tp_choices(cluster, config.num_heads)
    ks = pipeline_counts(cluster, options, config.num_layers)
    found: list[tuple[float, int, ClusterLayout]] = []
    others: list[tuple[float, int, ClusterLayout]] = []   # layouts of the TP maps that lost in descent
    for step, k in enumerate(ks):
        # uniform TP first
        best_tp, best_t, best_l = None, math.inf, None
        tried: set[tuple] = set()
        for t in sorted({t for ts in choices.values() for t in ts}):
            tp = {g: max([x for x in ts if x <= t] or [1]) for g, ts in choices.items()}
            tried.add(tuple(sorted(tp.items())))
            layout, obj = search.evaluate(k, tp)
            if layout is not None:
                others.append((obj, k, layout))
            if obj < best_t:
                best_tp, best_t, best_l = tp, obj, layout
        if best_tp is not None:
            # coordinate descent over device types, repeated until a whole pass changes nothing (one
            # pass can miss a type's best degree that only pays once another type's degree changed)
            changed = True
            while changed:
                changed = False
                for g in sorted(choices):
                    for t in choices[g]:
                        tp = dict(best_tp, **{g: t})
                        key = tuple(sorted(tp.items()))
                        if key in tried:
                            continue
                        tried.add(key)
                        layout, obj = search.evaluate(k, tp)
                        if layout is not None:
                            others.append((obj, k, layout))
                        if obj < best_t:
                            best_tp, best_t, best_l, changed = tp, obj, layout, True
            found.append((best_t, k, best_l))
        if progress:
            progress(step + 1, len(ks))
    if not found:
        raise InfeasibleError(f"no layout of {type(config).__name__}(num_layers={config.num_layers}) fits "
                              f"{cluster.summary()} with global batch {options.global_batch_size}; use fewer "
                              f"layers, a shorter sequence or more devices")
    found.sort(key=lambda x: (x[0], x[1]))
    layout = found[0][2]
    if options.refine:
        best_layout, best_est = None, None
        # the three best pipeline counts, and the two best other layouts (a TP map that loses before
        # refinement can win after it)
        chosen = [c for _, _, c in found[:3]]
        others.sort(key=lambda x: (x[0], x[1]))
        chosen += [c for _, _, c in others if c not in chosen][:2]
        for cand in chosen:
            lay, est = refine(cm, cand, options.refine_evaluations // 3, options.micro_batch_sizes)
            if best_est is None or est.objective < best_est.objective:
                best_layout, best_est = lay, est
        layout, est = best_layout, best_est
    else:
        est = cm.estimate(layout)
    return PlannerResult(layout, est, search.count, time.perf_counter() - t0)
