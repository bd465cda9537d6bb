"""`benchmarks/validate_costmodel.py` prices published runs with the planner's cost model, not a model of its own:
its figure for a published run equals the planner's estimate of the same layout built here from the published
sizes, and moves when the planner's pricing does."""
import importlib.util
import math
import pathlib
import sys

import pytest

from cfp.layout import Layout, Pipeline, Stage
from cfp.models.configs import GPTConfig
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel
from cfp.planner.step_features import GradSync, Recompute, StepFeatures
from cfp.schedules.registry import ScheduleName

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("validate_costmodel", ROOT / "benchmarks" / "validate_costmodel.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _megatron_7_5b():
    """SC'21 Table 1's 7.5B row: 128 A100-SXM (16 DGX nodes, NVLink 3 inside, HDR InfiniBand between), TP 4,
    PP 1, DP 32, global batch 512 in micro-batches of 1, full recomputation, fp16 gradients all-reduced."""
    cfg = GPTConfig(2048, 4096, 36, 32, 51200, dtype="bfloat16")
    cluster = parse_cluster({"inter_machine_bandwidth": "25GB/s", "machines": [
        {"gpu": "A100-SXM-80G", "count": 8, "intra_bandwidth": "300GB/s", "repeat": 16}]})
    pipes = tuple(Pipeline((Stage(tuple(range(4 * j, 4 * j + 4)), 36, j // 2),), 16, 16)
                  for j in range(32))
    features = StepFeatures(Recompute.FULL, False, GradSync.ALL_REDUCE, 2, False)
    return CostModel(cfg, cluster, ScheduleName.ONE_F_ONE_B, features=features), Layout(pipes)


def test_published_row_is_the_planners_estimate(bench):
    run = next(r for r in bench.RUNS if r.name == "GPT 7.5B")
    row, est, value, ratio = bench.estimate_row(run)
    cm, layout = _megatron_7_5b()
    want = cm.estimate(layout)
    assert math.isfinite(est.step_time) and est.step_time == pytest.approx(want.step_time, rel=1e-12)
    assert est.dp_time > 0 and est.dp_time == pytest.approx(want.dp_time, rel=1e-12)
    # Megatron's own FLOP count (SC'21 eq. 3) per GPU and second, against the published 142 TFLOP/s
    b, s, l, h, v = 512, 2048, 36, 4096, 51200
    flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert value == pytest.approx(flops / want.step_time / 128 / 1e12, rel=1e-12)
    assert ratio == pytest.approx(142 / value)


def test_the_benchmark_moves_with_the_planners_pricing(bench, monkeypatch):
    run = next(r for r in bench.RUNS if r.name == "GPT 7.5B")
    before = bench.estimate_row(run)[1]
    layer = CostModel.layer_seconds
    monkeypatch.setattr(CostModel, "layer_seconds", lambda self, *a: 2 * layer(self, *a))
    after = bench.estimate_row(run)[1]
    assert after.pipeline_time[0] > 1.5 * before.pipeline_time[0]


def test_every_published_row_prices_finite(bench):
    for run in bench.RUNS:
        row, est, value, ratio = bench.estimate_row(run)
        assert math.isfinite(value) and value > 0 and 0 < ratio < 10, row.name
        assert row.tp >= 1 and row.pp >= 1 and row.gpus % (row.tp * row.pp) == 0
