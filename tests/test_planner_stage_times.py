"""`cfp plan --stage-times`: stages measured by `cfp train --stage-plans search` priced by their measured time."""
import dataclasses

import pytest

from cfp.errors import ConfigError
from cfp.models import get_config
from cfp.planner.cluster import parse_cluster
from cfp.layout import Layout, Pipeline, Stage
from cfp.planner.costmodel import CostModel
from cfp.runtime.stage.plans import SearchedSharding, SearchFigures, StagePlan, StagePlans, Timing

LOCAL = {"inter_machine_bandwidth": "1.75GB/s",
         "machines": [{"gpu": "cpu", "count": 8, "intra_bandwidth": "1.75GB/s"}]}
MEASURED = 0.0123      # seconds per micro-batch of the TP-2 first stage below


def _saved_plans(tmp_path, config, time=MEASURED, profiler="measure", megatron=False):
    """Stage plans as a searched run saves them: pipeline 0 = [TP 2 with layers 0-1, TP 1 with layers 2-3]."""
    figures = SearchFigures(Timing(time), Timing(2 * time), profiler=profiler)
    one = StagePlan(0, 0, 2, (0, 2), 2, SearchedSharding((0,), ("S0",)), figures, megatron=megatron)
    two = StagePlan(0, 1, 1, (2, 4), 2)      # one device: nothing searched or timed
    layout = Layout.from_lists([[2, 1]], [[2, 2]], [4], [2], [[[0, 1], [2]]])
    StagePlans("llama2", layout, (one, two), dataclasses.asdict(config), "cpu").save(str(tmp_path))
    return str(tmp_path)


def _estimate(config, stage_times):
    cm = CostModel(config, parse_cluster(LOCAL), stage_times=stage_times)
    pipe = Pipeline((Stage((0, 1), 2, 0), Stage((2,), 2, 0)), batch=4, chunks=2)
    return cm.estimate(Layout((pipe,))).stages[0]


def test_measured_stage_replaces_the_estimate_only_for_its_shape(tmp_path):
    from cfp.cli.plan import load_stage_times
    config = get_config("llama2", "tiny", num_layers=4)
    times = load_stage_times(_saved_plans(tmp_path, config), "llama2", config)
    first, second = _estimate(config, times)
    plain_first, plain_second = _estimate(config, None)
    assert first.measured and first.fwd + first.bwd == pytest.approx(MEASURED)
    assert not second.measured and second == plain_second      # not measured: the model's figures
    assert not plain_first.measured and plain_first.fwd + plain_first.bwd != pytest.approx(MEASURED)
    assert first.memory == plain_first.memory                   # only the time is measured


def test_the_sharding_that_runs_gives_the_time(tmp_path):
    from cfp.cli.plan import load_stage_times
    config = get_config("llama2", "tiny", num_layers=4)
    times = load_stage_times(_saved_plans(tmp_path, config, megatron=True), "llama2", config)
    first, _ = _estimate(config, times)
    assert first.fwd + first.bwd == pytest.approx(2 * MEASURED)   # Megatron won that stage and runs


def test_estimated_stage_plans_give_no_measured_times(tmp_path):
    from cfp.cli.plan import load_stage_times
    config = get_config("llama2", "tiny", num_layers=4)
    times = load_stage_times(_saved_plans(tmp_path, config, profiler="estimate:A100-SXM-80G"), "llama2", config)
    assert not _estimate(config, times)[0].measured


def test_times_of_another_config_or_model_are_refused(tmp_path):
    from cfp.cli.plan import load_stage_times
    d = _saved_plans(tmp_path, get_config("llama2", "tiny", num_layers=4))
    with pytest.raises(ConfigError, match="num_layers"):
        load_stage_times(d, "llama2", get_config("llama2", "tiny", num_layers=6))
    with pytest.raises(ConfigError, match="'gpt'"):
        load_stage_times(d, "gpt", get_config("gpt", "tiny", num_layers=4))


def test_cli_plan_says_how_many_stages_were_measured(tmp_path, capsys):
    from cfp.cli.main import main
    config = get_config("llama2", "tiny", num_layers=4)
    d = _saved_plans(tmp_path, config)
    code = main(["plan", "--cluster", "examples/clusters/local.yaml", "--model", "llama2", "--num-layers", "4",
                 "--stage-times", d])
    out = capsys.readouterr().out
    assert code == 0 and "stages priced by times measured on cpu" in out
    code = main(["plan", "--cluster", "examples/clusters/local.yaml", "--model", "llama2", "--num-layers", "4",
                 "--stage-times", str(tmp_path / "missing")])
    assert code == 2


def test_a_plan_that_is_megatrons_sharding_gives_the_searched_time(tmp_path):
    """A searched plan that compiles to Megatron's sharding is not timed against itself (its Megatron time is 0):
    the planner gets the search's measured time of that sharding, never 0 s."""
    from cfp.cli.plan import load_stage_times
    config = get_config("llama2", "tiny", num_layers=4)
    one = StagePlan(0, 0, 2, (0, 2), 2, SearchedSharding((0,), ("S0",)),
                    SearchFigures(Timing(MEASURED), Timing(0.0), profiler="measure"), megatron=True)
    assert one.measured_time() == MEASURED
    layout = Layout.from_lists([[2, 1]], [[2, 2]], [4], [2], [[[0, 1], [2]]])
    StagePlans("llama2", layout, (one, StagePlan(0, 1, 1, (2, 4), 2)), dataclasses.asdict(config),
               "cpu").save(str(tmp_path))
    first, _ = _estimate(config, load_stage_times(str(tmp_path), "llama2", config))
    assert first.measured and first.fwd + first.bwd == pytest.approx(MEASURED)
