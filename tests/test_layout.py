"""The one layout type (`cfp.layout.Layout`): planner -> layout file -> `cfp train --layout` without a text
round trip, its JSON validated field by field, and layout flags beside a layout file compared as layouts."""
import json

import pytest

from cfp.cli.main import build_parser, main
from cfp.cli.train import layout_from_args
from cfp.errors import ConfigError
from cfp.layout import Layout, Pipeline, Stage
from cfp.models import get_config
from cfp.planner.cluster import parse_cluster
from cfp.planner.layout_file import LayoutFile, load_layout_file, write_layout_file
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import find_layout
from cfp.schedules.registry import ScheduleName

LOCAL = {"inter_machine_bandwidth": "1.75GB/s",
         "machines": [{"gpu": "cpu", "count": 8, "intra_bandwidth": "1.75GB/s"}]}
# the example: pipeline 0 = TP2, TP1, TP1 stages; pipeline 1 = one TP4 stage
EXAMPLE = Layout.from_lists([[2, 1, 1], [4]], [[2, 1, 1], [4]], [6, 2], [3, 1])


def _annotated(layout: Layout, machine: int = 0) -> Layout:
    return Layout(tuple(Pipeline(tuple(Stage(s.devices, s.layers, machine, s.cp) for s in p.stages), p.batch,
                                 p.chunks) for p in layout.pipelines))


def _write(tmp_path, layout: Layout, name="l.json") -> str:
    path = str(tmp_path / name)
    write_layout_file(path, LayoutFile("llama2", "tiny", {"num_layers": 4}, ScheduleName.GPIPE, layout,
                                       {"step_time_s": 1.0}, parse_cluster(LOCAL).to_dict()))
    return path


def test_plan_file_load_gives_an_equal_layout(tmp_path):
    """The planner's layout, machine annotations included, comes back equal from its file, and is what
    `cfp train --layout` hands the runtime."""
    cfg = get_config("llama2", "tiny", num_layers=4)
    planned = find_layout(parse_cluster(LOCAL), cfg, PlannerOptions(global_batch_size=16)).layout
    assert all(s.machine == 0 for p in planned.pipelines for s in p.stages)
    path = _write(tmp_path, planned)
    loaded = load_layout_file(path).layout
    assert loaded == planned and hash(loaded) == hash(planned)
    _, _, trained = layout_from_args(build_parser().parse_args(["train", "--layout", path]))
    assert trained == planned
    cp = Layout.from_schemes([(2, 2, 2), (1, 1, 1)], 4)       # context-parallel stages survive JSON too
    assert Layout.from_json(json.loads(json.dumps(cp.to_json()))) == cp


def test_placed_stages_follow_the_pipeline_order():
    placed = EXAMPLE.placed
    assert [s.key for s in placed] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert [(s.layer_start, s.layer_end) for s in placed] == [(0, 2), (2, 3), (3, 4), (0, 4)]
    assert [(s.is_first, s.is_last) for s in placed] == [(True, False), (False, False), (False, True),
                                                          (True, True)]
    assert EXAMPLE.place((0, 1)).module_names() == ["layers_2"]
    assert EXAMPLE.place((1, 0)).module_names() == ["embed"] + [f"layers_{i}" for i in range(4)] + ["head"]


def _stage0(d):
    return d["layout"]["pipelines"][0]["stages"][0]


@pytest.mark.parametrize("edit, message", [
    (lambda d: _stage0(d).update(layers=0), "layout.pipelines[0].stages[0].layers=0 must be a positive integer"),
    (lambda d: _stage0(d).update(devices=[0, "1"]), "layout.pipelines[0].stages[0].devices=[0, '1'] must be"),
    (lambda d: _stage0(d).update(tp=2), "layout.pipelines[0].stages[0]: unknown field 'tp'"),
    (lambda d: _stage0(d).update(machine=-1), "layout.pipelines[0].stages[0].machine=-1"),
    (lambda d: d["layout"]["pipelines"][0].update(chunks=4), "pipeline 0: batch=6 is not a positive multiple of "
                                                             "chunks=4"),
    (lambda d: d["layout"]["pipelines"][0].pop("batch"), "layout.pipelines[0]: missing field 'batch'"),
    (lambda d: d["layout"]["pipelines"][1]["stages"][0].update(devices=[0, 5, 6, 7]),
     "device 0 is used by stage (0, 0) and stage (1, 0)"),
    (lambda d: d["layout"]["pipelines"][1]["stages"][0].update(layers=3),
     "pipelines hold different numbers of layers [4, 3]"),
    (lambda d: d["layout"]["pipelines"][1]["stages"][0].update(devices=[4, 5, 6]),
     "TP degree 3 must divide num_heads=4"),
    (lambda d: d["layout"].update(version=7), "layout.version=7 is not 2; regenerate"),
    (lambda d: d.update(format="cfp-layout/1"), "older format 'cfp-layout/1' (written by an older cfp); "
                                                "regenerate it"),
])
def test_a_bad_field_is_a_one_line_error_naming_it(tmp_path, capsys, edit, message):
    path = _write(tmp_path, EXAMPLE)
    data = json.load(open(path))
    edit(data)
    json.dump(data, open(path, "w"))
    with pytest.raises(ConfigError) as e:
        load_layout_file(path)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert f"layout file {path!r}" in str(e.value)
    code = main(["train", "--layout", path, "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags", [
    ["--hetero-configs", "[[2,1,1],[4]]"],                    # the refused example
    ["--hetero-configs", "[[2, 1, 1], [4]]", "--layer-partitions", "[[2,1,1],[4],]"],   # other text, same lists
    ["--devices-id", "[[[0,1],[2],[3]],[[4,5,6,7]]]"],
    ["--global-batch-size", "6", "2", "--chunks", "3", "1"],
])
def test_layout_flags_equal_to_the_file_are_accepted(tmp_path, flags):
    path = _write(tmp_path, _annotated(EXAMPLE))
    _, _, layout = layout_from_args(build_parser().parse_args(["train", "--layout", path] + flags))
    assert layout == load_layout_file(path).layout        # the file's layout, machine annotations kept


@pytest.mark.parametrize("flags, given", [
    (["--hetero-configs", "[[2,1,1],[4]]", "--layer-partitions", "[[1,2,1],[4]]"],
     "give tp2x1L[0,1]+tp1x2L[2]+tp1x1L[3] (3x2) | tp4x4L[4,5,6,7] (1x2)"),
    (["--devices-id", "[[[0,1],[3],[2]],[[4,5,6,7]]]"], "give tp2x2L[0,1]+tp1x1L[3]+tp1x1L[2] (3x2) | "
                                                        "tp4x4L[4,5,6,7] (1x2)"),
    (["--hetero-configs", "[[1,1,1],[4]]"], "give an invalid layout (devices_id[0][0]=[0, 1] has 2 devices"),
    (["--global-batch-size", "6"], "--global-batch-size 6 give tp2x2L[0,1]+tp1x1L[2]+tp1x1L[3] (3x2) | "
                                   "tp4x4L[4,5,6,7] (1x6)"),        # padded to 6 6: another batch split
])
def test_layout_flags_other_than_the_file_are_refused_naming_both(tmp_path, capsys, flags, given):
    path = _write(tmp_path, _annotated(EXAMPLE))
    with pytest.raises(ConfigError) as e:
        layout_from_args(build_parser().parse_args(["train", "--layout", path] + flags))
    text = str(e.value)
    assert given in text and (f"layout file {path!r} has layout tp2x2L[0,1]+tp1x1L[2]+tp1x1L[3] (3x2) | tp4x4L[4,5,6,7] (1x2)"
                               in text)
    assert main(["train", "--layout", path, "--steps", "1"] + flags) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_model_flags_beside_a_layout_file_must_agree(tmp_path):
    path = _write(tmp_path, EXAMPLE)
    config, _, _ = layout_from_args(build_parser().parse_args(["train", "--layout", path, "--num-layers", "4"]))
    assert config.num_layers == 4
    with pytest.raises(ConfigError, match=r"--num-layers=2 conflicts with layout file .*\(num_layers 4\)"):
        layout_from_args(build_parser().parse_args(["train", "--layout", path, "--num-layers", "2"]))
    with pytest.raises(ConfigError, match=r"--model=gpt conflicts with layout file"):
        layout_from_args(build_parser().parse_args(["train", "--layout", path, "--model", "gpt"]))


def test_an_unchecked_layout_is_checked_before_it_is_handed_on():
    """The planner's candidates skip the checks; `checked` (which the planner's result passes through) runs
    them."""
    bad = Layout.unchecked((Pipeline((Stage((0, 1), 2), Stage((1,), 2)), 4, 2),))
    with pytest.raises(ConfigError, match=r"device 1 is used by stage \(0, 0\) and stage \(0, 1\)"):
        bad.checked()
    good = Layout.unchecked(EXAMPLE.pipelines)
    assert good.checked() == EXAMPLE == good
