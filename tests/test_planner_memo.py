"""The planner's memos answer as a fresh cost model does (issue 40 item 1: planning time).

Planning at scale memoises stage figures by pipeline shape, layer splits by stage order and schedule counts, the
recompute policy with its peak, and the gradient sync's narrowest TP degrees by interned tokens. A key that
misses something its figure depends on returns another query's figure silently, and a plan comparison only sees
it where the search met both queries. So here one warm cost model answers a sequence of queries that differ in
one thing each (a pipeline's place, its micro-batch count, a layer moved, the pipelines' order), and every answer
is checked against a fresh cost model asked that one question, stage by stage through `stage_estimate` (not the
pipeline memo), and each stage's memory against `stage_memory` at its priced policy (not the policy memo).
"""
from __future__ import annotations

import itertools

import pytest

from cfp.layout import Layout, Pipeline, Stage
from cfp.models import get_config
from cfp.planner.build import split_layers
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import find_layout
from cfp.planner.refine import _Budget, _device_moves, _order_moves, _rebuild, _tp_moves, refine
from cfp.planner.step_features import Among

# memory-tight: 7B in float32 on 24 GB and 40 GB devices, so places, micro-batch counts and policies all matter
CLUSTER = parse_cluster({"inter_machine_bandwidth": "12.5GB/s", "machines": [
    {"gpu": "RTX4090", "count": 8, "intra_bandwidth": "25GB/s", "repeat": 2},
    {"gpu": "A100-PCIe-40G", "count": 8, "intra_bandwidth": "32GB/s", "repeat": 2}]})
CFG = get_config("llama2", "7B")
SCHEDULE = "auto"


@pytest.fixture(scope="module")
def planned() -> Layout:
    layout = find_layout(CLUSTER, CFG, PlannerOptions(global_batch_size=64, schedule=SCHEDULE,
                                                      recompute="auto")).layout
    assert len(layout.pipelines) >= 2       # else no query below differs in its place
    return layout


def _fresh() -> CostModel:
    return CostModel(CFG, CLUSTER, SCHEDULE)


def _variants(layout: Layout) -> list[Layout]:
    """The layout, its pipelines in other orders (each pipeline at the other place), micro-batches moved between
    pipelines, and one layer moved between neighbouring stages of each pipeline."""
    pipes = list(layout.pipelines)
    out = [layout, Layout.unchecked(tuple(pipes[::-1])), Layout.unchecked(tuple(pipes[1:] + pipes[:1]))]
    for a, b in ((0, 1), (1, 0)):
        pa, pb = pipes[a], pipes[b]
        if pa.chunks > 1 and pa.micro_batch == pb.micro_batch:
            moved = list(pipes)
            moved[a] = Pipeline(pa.stages, pa.batch - pa.micro_batch, pa.chunks - 1)
            moved[b] = Pipeline(pb.stages, pb.batch + pb.micro_batch, pb.chunks + 1)
            out.append(Layout.unchecked(tuple(moved)))
    for p, pipe in enumerate(pipes):
        for i in range(len(pipe.stages) - 1):
            st = list(pipe.stages)
            if st[i].layers > 1:
                st[i], st[i + 1] = (Stage(st[i].devices, st[i].layers - 1, st[i].machine),
                                    Stage(st[i + 1].devices, st[i + 1].layers + 1, st[i + 1].machine))
                out.append(Layout.unchecked(tuple(pipes[:p] + [Pipeline(tuple(st), pipe.batch, pipe.chunks)]
                                                  + pipes[p + 1:])))
    return out


@pytest.fixture(scope="module")
def explored(planned) -> tuple[CostModel, dict]:
    """A warm cost model after a refinement from the planned layout (hundreds of layouts estimated and rebuilt,
    as the search asks) and the layouts with its pipelines at other places, micro-batches and layer splits."""
    warm, memo = _fresh(), {}
    refine(warm, planned, 300, (1, 2, 4), memo)
    bud = _Budget(warm, 10 ** 6, memo)
    moves = itertools.chain(_order_moves(planned), _tp_moves(warm, planned),
                            _device_moves(planned, bud.estimate(planned)))
    for new, changed in itertools.islice(moves, 80):     # structural moves: stage orders, TP groups, machines
        for mb in (1, 2):
            lay = bud.rebuild(new, changed, planned.global_batch, mb)
            if lay is not None:
                bud.estimate(lay)
    for v in _variants(planned):
        bud.estimate(v)
    return warm, memo


def _check_estimate(layout: Layout, est) -> None:
    n = len(layout.pipelines)
    assert est.dp_time == _fresh().estimate(layout).dp_time
    for p, (pipe, spec) in enumerate(zip(layout.pipelines, est.schedules)):
        place, stages, fresh = Among(n, p == 0), pipe.stages, _fresh()
        want = [fresh.stage_estimate(st, i, pipe, place, stages[i + 1] if i + 1 < len(stages) else None, spec)
                for i, st in enumerate(stages)]
        assert list(est.stages[p]) == want, p
        for i, (st, e) in enumerate(zip(stages, est.stages[p])):
            assert e.memory == _fresh().stage_memory(st, i, pipe, place, spec, e.recompute), (p, i)


def test_pipeline_figures_are_a_fresh_models_stage_by_stage(explored):
    _, memo = explored
    estimated = list(memo["estimates"].items())
    assert len(estimated) > 100 and len({len(lay.pipelines) for lay, _ in estimated}) >= 1
    for layout, est in estimated:
        _check_estimate(layout, est)


def test_rebuilt_layouts_are_a_fresh_models(explored):
    """The search's layer splits, stage orders and micro-batch counts (`refine`'s rebuilds) as a fresh model makes
    them."""
    _, memo = explored
    rebuilt = [(key, lay) for key, lay in memo["rebuilds"].items()]
    assert len(rebuilt) > 20 and any(lay is not None for _, lay in rebuilt)
    for (pipes, changed, batch, mb), lay in rebuilt:
        assert _rebuild(_Budget(_fresh(), 10 ** 6), pipes, set(changed), batch, mb) == lay


# two RTX 4090 stages, then six A100 stages: on one A100 machine, or alternating between two (the same stages by
# type and degree, other links between them: a 12-layer 7B splits them differently)
ONE_MACHINE = [Stage((0,), 0, 0), Stage((1,), 0, 0)] + [Stage((16 + i,), 0, 2) for i in range(6)]
ALTERNATING = ONE_MACHINE[:2] + [Stage((16 + i // 2 + 8 * (i % 2),), 0, 2 + i % 2) for i in range(6)]
CFG12 = get_config("llama2", "7B", num_layers=12)


def _split_queries(cfg, orders, n: int) -> list:
    """Every order at both places, micro-batch sizes and counts, asked of one warm model in turn, split as a fresh
    model splits each."""
    queries = [(stages, mb, c, Among(n, first)) for stages in orders for mb in (1, 2, 4) for c in (1, 2, 4, 8, 32)
               for first in (True, False)]
    warm = CostModel(cfg, CLUSTER, SCHEDULE)
    got = [split_layers(warm, stages, c * mb, c, place) for stages, mb, c, place in queries]
    assert got == [split_layers(CostModel(cfg, CLUSTER, SCHEDULE), stages, c * mb, c, place)
                   for stages, mb, c, place in queries]
    return got


def test_layer_splits_are_a_fresh_models(planned):
    _split_queries(CFG, [pipe.stages for pipe in planned.pipelines], len(planned.pipelines))
    got = _split_queries(CFG12, [ONE_MACHINE, ALTERNATING], 2)
    # the two orders split apart (else a memo keyed without the links would pass)
    half = len(got) // 2
    assert any(a is not None and b is not None and [s.layers for s in a] != [s.layers for s in b]
               for a, b in zip(got[:half], got[half:]))
