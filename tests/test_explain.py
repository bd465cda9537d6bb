"""cfp explain / diff / --plot on the golden plans and on saved plan files; bad inputs give one line, exit 2."""
import json
import shutil
from pathlib import Path

import pytest

from cfp.cli.main import main
from cfp.errors import ConfigError
from cfp.report.explain import diff_text, explain_text, load_view
from cfp.report.figures import BlockFigures

GOLDEN = Path(__file__).resolve().parent / "golden" / "plans"


@pytest.fixture(scope="module")
def gpt_view():
    return load_view(str(GOLDEN / "gpt_2x4.json"))


def test_explain_golden_plan_names_scopes_strategies_and_costs(gpt_view):
    golden = json.loads((GOLDEN / "gpt_2x4.json").read_text())
    assert [f.strategy for f in gpt_view.figures] == golden["strategies"]
    assert gpt_view.figures[-1].scope == "head/lm_head"
    assert any("mlp/fc_in" in f.scope for f in gpt_view.figures)
    for f in gpt_view.figures:
        assert f.compute_s > 0 and f.comm_s >= 0 and f.memory_bytes > 0
        assert f.runner_up is not None and f.runner_up != f.strategy
    text = explain_text(gpt_view)
    assert "estimates (A100-SXM-80G)" in text and "head/lm_head" in text


def test_figures_follow_the_gpu(gpt_view):
    slow = load_view(str(GOLDEN / "gpt_2x4.json"), gpu="V100-SXM2-32G")     # FP32 CUDA cores, slower link
    assert all(s.compute_s > f.compute_s for s, f in zip(slow.figures, gpt_view.figures))


def test_diff_of_two_golden_plans_lists_differing_blocks(gpt_view):
    other = load_view(str(GOLDEN / "gpt_8.json"))
    text = diff_text(gpt_view, other)
    differ = [i for i in range(9) if gpt_view.strategies[i] != other.strategies[i]]
    assert f"{len(differ)} of 9 blocks differ" in text
    assert "B - A" in text
    assert diff_text(gpt_view, gpt_view).splitlines()[2] == "0 of 9 blocks differ"


def test_block_figures_round_trip_and_reject_malformed():
    f = BlockFigures(3, "layers_0/mlp/fc_in", 0, "SRR = SRR x RR @ {0}", 1e-3, 2e-4, 1024, "RRS", 5e-4)
    assert BlockFigures.from_dict(json.loads(json.dumps(f.to_dict()))) == f
    with pytest.raises(ConfigError, match="malformed"):
        BlockFigures.from_dict({"block": 1})


def test_old_plan_file_without_estimates_still_explains(tmp_path):
    old = {"mesh_shape": [8], "axis_names": ["x"], "choice": [0, 1], "strategies": ["SR = SR x RR", "RS = RR x RS"],
           "block_fingerprints": ["a", "b"], "input_specs": {}, "output_specs": [], "metrics": {}, "version": 1}
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    view = load_view(str(p))
    assert view.figures == () and "no per-block estimates" in explain_text(view)


def test_plot_golden_plan(tmp_path, gpt_view):
    from cfp.report.plot import plot_plan
    out = plot_plan(gpt_view, str(tmp_path / "p.png"))
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,needle", [
    (["explain", "/nonexistent/plan.json"], "cannot read plan file '/nonexistent/plan.json'"),
    (["explain", "{bad}"], "is not valid JSON"),
    (["explain", "{gold}", "--gpu", "A1000"], "unknown gpu 'A1000'"),
    (["diff", "{gold}", "/nonexistent/b.json"], "cannot read plan file"),
    (["explain", "{notplan}"], "is not a cfp plan"),
])
def test_bad_inputs_are_one_line_exit_2(tmp_path, capsys, argv, needle):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    notplan = tmp_path / "notplan.json"
    notplan.write_text("[1, 2]")
    gold = tmp_path / "gold.json"
    shutil.copy(GOLDEN / "gpt_8.json", gold)
    argv = [a.format(bad=bad, gold=gold, notplan=notplan) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_plan_file_carries_estimates_and_old_files_still_load(tmp_path, gpt_view):
    from cfp.search.plan import Plan, load_plan
    est = tuple(f.to_dict() for f in gpt_view.figures)
    prof = ({"segment_kind": 0, "choice": [0], "time_s": 1e-3, "memory_bytes": 10, "measured": False,
             "chosen": True},)
    plan = Plan((8,), ("x",), gpt_view.choice, gpt_view.strategies, ("f",) * 9, {}, (), {"estimates_gpu": "H100-SXM"},
                (), 2, est, prof)
    path = plan.save(str(tmp_path / "p.json"))
    assert load_plan(path) == plan
    view = load_view(path)
    assert view.figures == gpt_view.figures and view.profile == prof and view.gpu == "H100-SXM"
    d = json.loads(Path(path).read_text())
    del d["estimates"], d["profile"]
    Path(path).write_text(json.dumps(d))
    assert load_plan(path).estimates == () and load_view(path).figures == ()
