"""The heterogeneous-cluster planner (HexiScale): pipelines by METIS, stages by METIS, layers by stage
speed under memory, batch by pipeline throughput, then refinement; searched over the number of
pipelines and the TP degree of each device type.

Search: for every pipeline count, phase 1's METIS cut (`split_pipelines`), then TP maps (uniform degrees,
then coordinate descent over types); where no map of METIS' cut fits, the same on phase 1's equal-share cut
(`split_by_type`). The best map of every count is tried again with phase 2's compute-balanced METIS stage cut
offered and on the equal-share cut; the three best counts, the two best other maps and the best equal-share
layout are refined (`refine`) and the fastest estimate wins.

Beyond `METIS_MAX_EDGES` edges of phase 1's device graph (about 2,000 devices of 8-device machines) phase 1 is
the equal-share cut alone: METIS' cut of the 4096-device graph (2.1M edges) took 0.7-1.7 s of CPU per pipeline
count and scattered machines over pipelines (1-2 devices each, so TP 1 on 24 GB devices) until no layout fit,
where the equal-share cut's pipelines of whole machines planned at a step below four copies of the 1024-device
plan (measured, `benchmarks/planner_scale.py`)."""
from __future__ import annotations

import collections
import contextlib
import functools
import gc
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from cfp.errors import InfeasibleError
from cfp.layout import Layout, Stage
from cfp.planner.build import build_layout, orders_signature, stage_layouts
from cfp.planner.cluster import Cluster, as_cluster
from cfp.planner.costmodel import CostModel, Estimate
from cfp.planner.metis import (balanced_stages, cluster_graph, machine_groups, phase1_edges, split_by_type,
                               split_pipelines, split_stages, stage_orders)
from cfp.planner.options import PlannerOptions
from cfp.planner.refine import refine
from cfp.planner.step_features import Among

METIS_MAX_EDGES = 1_000_000   # phase 1's device graph beyond this: the equal-share cut alone (module docstring)

@dataclass(frozen=True)
class PlannerResult:
    layout: Layout
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
        self._phase2: dict[tuple, tuple[list, tuple]] = {}
        self._balanced: dict[tuple, list[list[int]]] = {}
        self._shapes: dict[tuple, tuple] = {}     # phase 2 by pipeline shape: (its devices, machines, result)
        self._holds: dict[tuple, bool] = {}
        self.tps = tuple(sorted({t for ts in tp_choices(cm.cluster, cm.model.tp_divisor).values() for t in ts}))
        self.count = 0

    @functools.cached_property
    def _graph(self) -> tuple:
        """Phase 1's METIS graph (`cluster_graph`), built once for every pipeline count."""
        return cluster_graph(self.cm.cluster, self.rate)

    @functools.cached_property
    def metis_phase1(self) -> bool:
        """Whether phase 1 cuts by METIS: its device graph has at most `METIS_MAX_EDGES` edges."""
        return phase1_edges(self.cm.cluster) <= METIS_MAX_EDGES

    def pipelines(self, k: int, by_type: bool = False) -> list[list[int]]:
        """Phase 1: `k` pipelines by METIS, or (`by_type`) by dealing each device type out evenly."""
        if (k, by_type) not in self._phase1:
            self._phase1[k, by_type] = (split_by_type(self.cm.cluster, k) if by_type
                                        else split_pipelines(self.cm.cluster, k, self.rate, self._graph))
        return self._phase1[k, by_type]

    def stages(self, devices: list[int], tp_of, metis: bool) -> tuple[list, tuple]:
        """Phase 2 and the candidate stage orders of one pipeline, as stage layouts with their signature
        (cached: pipelines recur across TP maps); with `metis`, METIS' compute-balanced cut is offered beside
        one TP degree per type."""
        cl = self.cm.cluster
        machines = sorted({cl.devices[d].machine for d in devices})
        key = (tuple(devices), tuple(tp_of(m) for m in machines), metis)
        if key in self._phase2:
            return self._phase2[key]
        per = collections.Counter(cl.devices[d].machine for d in devices)
        shape = (tuple((self.cm.kind[m], per[m], tp_of(m)) for m in machines), metis)
        like = self._shapes.get(shape)
        if like is not None:     # the same cut of a pipeline of like machines, relabelled (`_relabelled`)
            self._phase2[key] = _relabelled(like, sorted(devices), machines)
            return self._phase2[key]
        heads = self.cm.model.tp_divisor
        cuts = [machine_groups(cl, devices, tp_of, heads)]
        if metis:
            parts = (tuple(devices), len(cuts[0]))   # the METIS cut depends on the stage count only
            if parts not in self._balanced:
                self._balanced[parts] = balanced_stages(cl, devices, parts[1], self.rate, heads)
            cuts = split_stages(cl, cuts[0], self._balanced[parts])
        orders = []
        for groups in cuts:        # one `Stage` per group, shared by the orders (building them is costly)
            made = {g[0]: st for g, st in zip(groups, stage_layouts(self.cm, groups))}
            orders += [[made[g[0]] for g in o] for o in stage_orders(cl, groups)]
        self._phase2[key] = (orders, orders_signature(self.cm, orders))
        self._shapes[shape] = (sorted(devices), machines, self._phase2[key])
        return self._phase2[key]

    def holds_model(self, k: int, groups: list[list[int]]) -> bool:
        """Whether each of the `k` device groups (pipeline 0's first) holds `CostModel.pipeline_memory_floor` at
        its place (a pipeline that cannot fits no split into stages: the count's layouts need not be built)."""
        mem = self.cm.cluster.devices
        floors = [self.cm.pipeline_memory_floor(Among(k, p == 0), self.tps) for p in range(min(k, 2))]
        return all(sum(mem[d].memory for d in g) >= floors[min(p, 1)] for p, g in enumerate(groups))

    def pipeline_zero_first(self, groups: list[list[int]]) -> list[list[int]]:
        """The groups with the one of most device memory first (the first stable among equals): pipeline 0 also
        holds the optimizer state (`Among`), so it goes where the most memory is."""
        mem = self.cm.cluster.devices
        most = max(range(len(groups)), key=lambda p: (sum(mem[d].memory for d in groups[p]), -p))
        return [groups[most]] + groups[:most] + groups[most + 1:]

    def evaluate(self, k: int, tp: dict[str, int], metis: bool = False, by_type: bool = False
                 ) -> tuple[Optional[Layout], float]:
        cl = self.cm.cluster
        tp_of = lambda m: tp[cl.machines[m].gpu.name]
        groups = self.pipeline_zero_first(self.pipelines(k, by_type))
        if (k, by_type) not in self._holds:
            self._holds[k, by_type] = self.holds_model(len(groups), groups)
        if not self._holds[k, by_type]:
            return None, math.inf
        pipes = [self.stages(g, tp_of, metis) for g in groups]
        best, best_t = None, math.inf
        for mb in self.options.micro_batch_sizes:
            layout = build_layout(self.cm, [p[0] for p in pipes], self.options.global_batch_size, mb,
                                  [p[1] for p in pipes])
            if layout is None:
                continue
            self.count += 1
            t = self.cm.estimate(layout).objective
            if t < best_t:
                best, best_t = layout, t
        return best, best_t

    def tp_maps(self, k: int, choices: dict[str, list[int]], by_type: bool = False) -> list[_Candidate]:
        """Every (TP map, layout) tried for `k` pipelines (`by_type`: on phase 1's equal-share cut), the best
        first: uniform degrees, then coordinate descent over device types, repeated until a whole pass changes
        nothing (one pass can miss a type's best degree that only pays once another type's degree changed)."""
        tried: dict[tuple, _Candidate] = {}

        def attempt(tp: dict[str, int]) -> float:
            key = tuple(sorted(tp.items()))
            if key not in tried:
                layout, obj = self.evaluate(k, tp, by_type=by_type)
                tried[key] = _Candidate(obj, k, key, layout, by_type)
            return tried[key].objective

        best_tp, best_t = None, math.inf
        for t in sorted({t for ts in choices.values() for t in ts}):
            tp = {g: max([x for x in ts if x <= t] or [1]) for g, ts in choices.items()}
            # phase 2's METIS cut is not offered here but to the best maps afterwards (`_with_metis`):
            # offered to every uniform degree of every pipeline count it cost about 40% of the planning
            # time at 1024 GPUs and changed no pick on the test clusters (two layouts regrouped devices
            # of one machine, at the same estimate)
            obj = attempt(tp)
            if obj < best_t:
                best_tp, best_t = tp, obj
        changed = best_tp is not None
        while changed:
            changed = False
            for g in sorted(choices):
                for t in choices[g]:
                    tp = dict(best_tp, **{g: t})
                    obj = attempt(tp)
                    if obj < best_t:
                        best_tp, best_t, changed = tp, obj, True
        return sorted((c for c in tried.values() if c.layout is not None), key=lambda c: (c.objective, c.k))


def _relabelled(like: tuple, devices: list[int], machines: list[int]) -> tuple[Sequence, tuple]:
    """Phase 2's stage orders of a pipeline of like machines (`like`: its sorted devices, machines and result) on
    `devices` of `machines`: every step of phase 2 (TP groups, METIS' graph of the pipeline, the greedy order and
    its tie-breaks) sees devices by position in machine-major order and machines by spec, so mapping the one
    pipeline's devices and machines onto the other's in order gives the cut phase 2 makes of it."""
    had, had_machines, (orders, signature) = like
    return _Relabelled(orders, dict(zip(had, devices)), dict(zip(had_machines, machines))), signature


class _Relabelled(Sequence):
    """Stage orders mapped onto other devices and machines, each order when first asked for (`build_layout`
    mostly reads only the order its memo picked)."""

    def __init__(self, orders: Sequence, dmap: dict, mmap: dict):
        self._orders, self._dmap, self._mmap, self._made = orders, dmap, mmap, {}
        self.source = orders    # what `build.best_order` searches instead: the same signature, nothing to map

    def __len__(self) -> int:
        return len(self._orders)

    def __getitem__(self, i: int) -> list[Stage]:
        got = self._made.get(i)
        if got is None:
            d, m = self._dmap, self._mmap
            got = self._made[i] = [Stage(tuple(d[x] for x in st.devices), st.layers, m[st.machine])
                                   for st in self._orders[i]]
        return got


@dataclass(frozen=True)
class _Candidate:
    objective: float
    k: int
    tp: tuple          # sorted (device type, TP degree) pairs
    layout: Optional[Layout]
    by_type: bool = False   # on phase 1's equal-share cut (else METIS')


def _with_metis(search: _Search, cand: _Candidate) -> _Candidate:
    """The candidate, or the layout its (pipelines, TP map) gives with METIS' compute-balanced stage
    cut offered too (phase 2), whichever the cost model estimates faster."""
    layout, obj = search.evaluate(cand.k, dict(cand.tp), metis=True, by_type=cand.by_type)
    return (_Candidate(obj, cand.k, cand.tp, layout, cand.by_type) if layout is not None and obj < cand.objective
            else cand)


def _by_type(search: _Search, cand: _Candidate) -> Optional[_Candidate]:
    """The candidate's pipeline count and TP map on phase 1's by-type cut (`split_by_type`)."""
    layout, obj = search.evaluate(cand.k, dict(cand.tp), metis=search.options.phase2_metis, by_type=True)
    return None if layout is None else _Candidate(obj, cand.k, cand.tp, layout, True)


def _refine_all(cm: CostModel, picked: list[Layout], options: PlannerOptions
                ) -> tuple[Layout, Estimate]:
    """The best of the `picked` layouts after refinement. Each distinct layout once, with a third of
    `refine_evaluations` per pick (a layout picked twice would be refined twice to the same result, so
    the budget of the repeats goes to the distinct layouts); the descents share their memo (`refine`),
    and what they leave unspent (a descent that stops in a local optimum or meets an earlier one's)
    continues the best one, whose descent may have stopped for want of budget."""
    layouts = list(dict.fromkeys(picked))
    if not options.refine:
        ests = [cm.estimate(lay) for lay in layouts]
        i = min(range(len(layouts)), key=lambda i: ests[i].objective)
        return layouts[i], ests[i]
    budget = options.refine_evaluations // 3 * len(picked) // len(layouts)
    memo: dict = {}
    best, spare = None, 0
    for cand in layouts:
        lay, est, left = refine(cm, cand, budget, options.micro_batch_sizes, memo)
        spare += left
        if best is None or est.objective < best[1].objective:
            best = (lay, est)
    if spare > 0:
        lay, est, _ = refine(cm, best[0], spare, options.micro_batch_sizes, memo)
        if est.objective < best[1].objective:
            best = (lay, est)
    return best


@contextlib.contextmanager
def _collector_paused():
    """Python's cycle collector off for the duration (restored after, as it was). Planning at scale builds
    ~10^6 small objects that reference counting frees (memo keys, stages, figures; no cycles), and the
    collector's full passes over them and over everything the process held before (JAX's modules) took
    about 15% of the CPU time of planning 1024 GPUs while finding nothing to free."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def find_layout(cluster: Cluster, config, options: PlannerOptions,
                progress: Optional[Callable[[int, int], None]] = None) -> PlannerResult:
    """The best layout the planner finds for `config` (a zoo model config, or a model's derived
    `cfp.layered.facts.CostFacts`) on `cluster` (a `Cluster`, a cluster file's path or its mapping; deterministic)."""
    cluster = as_cluster(cluster)
    with _collector_paused():
        return _find_layout(cluster, config, options, progress)


def _find_layout(cluster: Cluster, config, options: PlannerOptions,
                 progress: Optional[Callable[[int, int], None]]) -> PlannerResult:
    t0 = time.perf_counter()
    cm = CostModel(config, cluster, options.schedule, options.stage_times, options.features)
    search = _Search(cm, options)
    choices = tp_choices(cluster, cm.model.tp_divisor)
    # a count whose pipelines together cannot hold their floors has a pipeline that cannot (`holds_model`)
    total = sum(d.memory for d in cluster.devices)
    floor = lambda k, updates: cm.pipeline_memory_floor(Among(k, updates), search.tps)
    ks = [k for k in pipeline_counts(cluster, options, cm.model.num_layers)
          if floor(k, True) + (k - 1) * floor(k, False) <= total]
    found: list[_Candidate] = []     # the best TP map per pipeline count
    others: list[_Candidate] = []    # the TP maps that lost
    shares: list[_Candidate] = []   # the best TP map per count on the equal-share cut where METIS' fits none
    for step, k in enumerate(ks):
        tried = search.tp_maps(k, choices) if search.metis_phase1 else []
        if tried:
            found += tried[:1]
            others += tried[1:]
        else:                       # METIS' cut fits no TP map (or is not made at this scale): the equal shares
            shares += search.tp_maps(k, choices, by_type=True)[:1]
        if progress:
            progress(step + 1, len(ks))
    if not found and not shares:
        raise InfeasibleError(f"no layout of {cm.model.name} ({cm.model.num_layers} layers) fits "
                              f"{cluster.summary()} with global batch {options.global_batch_size}; use fewer "
                              f"layers, a shorter sequence or more devices")
    key = lambda c: (c.objective, c.k)
    found.sort(key=key)
    others.sort(key=key)
    if options.phase2_metis:
        # phase 2's METIS cut for the best TP map of every pipeline count and the two best other maps
        # (a cut that balances compute can turn the ranking), then ranked again
        found = [_with_metis(search, c) for c in found]
        others = [_with_metis(search, c) for c in others[:2]] + others[2:]
        found.sort(key=key)
        others.sort(key=key)
    # phase 1's other cut, pipelines of equal type shares, for the best TP map of every pipeline count (and the
    # counts METIS' cut fitted none of)
    typed = sorted([c for c in (_by_type(search, c) for c in found) if c is not None]
                   + [_with_metis(search, c) if options.phase2_metis else c for c in shares], key=key)
    # refined: the three best pipeline counts, the two best other TP maps (one that loses before
    # refinement can win after it) and the best equal-share cut
    picked = [c.layout for c in found[:3] + others[:2] + typed[:1]]
    best_layout, best_est = _refine_all(cm, picked, options)
    return PlannerResult(best_layout.checked(), best_est, search.count, time.perf_counter() - t0)
