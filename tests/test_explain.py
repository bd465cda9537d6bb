"""cfp explain / diff / --plot on the golden plans and on saved plan files; bad inputs give one line, exit 2.

The golden plans are `Plan`s saved by `cfp.autoshard` (benchmarks/regen_golden_plans.py), the same format as
`cfp search --plan-out`'s."""
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
    assert gpt_view.gpu == "A100-SXM-80G" and gpt_view.meta["model"] == "gpt"
    assert gpt_view.figures[-1].scope == "head/lm_head"
    assert any("mlp/fc_in" in f.scope for f in gpt_view.figures)
    for f in gpt_view.figures:
        assert f.compute_s > 0 and f.comm_s >= 0 and f.memory_bytes > 0
        assert f.runner_up is not None and f.runner_up != f.strategy
    text = explain_text(gpt_view)
    assert "estimates (A100-SXM-80G)" in text and "head/lm_head" in text


def test_figures_follow_the_gpu(gpt_view):
    """--gpu recomputes the figures (from the model the plan names), never relabels the saved ones."""
    slow = load_view(str(GOLDEN / "gpt_2x4.json"), gpu="V100-SXM2-32G")     # FP32 CUDA cores, slower link
    assert slow.gpu == "V100-SXM2-32G"
    assert all(s.compute_s > f.compute_s for s, f in zip(slow.figures, gpt_view.figures))
    same = load_view(str(GOLDEN / "gpt_2x4.json"), gpu="A100-SXM-80G")
    assert same.figures == gpt_view.figures


def test_plan_of_an_unnamed_step_is_not_relabelled_for_another_gpu(tmp_path, capsys):
    d = json.loads((GOLDEN / "gpt_8.json").read_text())
    for k in ("model", "model_config", "batch_size"):
        del d["metrics"][k]
    p = tmp_path / "own.json"
    p.write_text(json.dumps(d))
    assert load_view(str(p)).gpu == "A100-SXM-80G"
    assert main(["explain", str(p), "--gpu", "H100-SXM"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not name its model" in err and len(err.splitlines()) == 1


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


@pytest.mark.parametrize("argv", [["explain", "{edited}"], ["diff", "{gold}", "{edited}"],
                                  ["explain", "{edited}", "--gpu", "V100-SXM2-32G"]])
def test_out_of_range_choice_is_one_line_exit_2(tmp_path, capsys, argv):
    """A golden (or any saved) plan edited to choice 99: one line naming the block and the valid range."""
    d = json.loads((GOLDEN / "gpt_8.json").read_text())
    d["choice"][3] = 99
    edited, gold = tmp_path / "edited.json", tmp_path / "gold.json"
    edited.write_text(json.dumps(d))
    shutil.copy(GOLDEN / "gpt_8.json", gold)
    assert main([a.format(edited=edited, gold=gold) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "block 3's strategy 99 is out of range" in err, err


def test_out_of_range_choice_is_refused_by_load_and_apply(tmp_path):
    from cfp.errors import PlanError
    from cfp.search.plan import load_plan
    d = json.loads((GOLDEN / "gpt_8.json").read_text())
    d["choice"][3] = 99
    p = tmp_path / "edited.json"
    p.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"block 3's strategy 99 is out of range: it has \d+ strategies"):
        load_plan(str(p))
    del d["num_strategies"]          # a version-2 file, which has no strategy counts: apply still refuses it
    d["version"] = 2
    p.write_text(json.dumps(d))
    plan = load_plan(str(p))
    import cfp
    ts, args = _golden_args()
    with pytest.raises(ConfigError, match="strategy 99 of block 3 is out of range"):
        cfp.apply_plan(ts.step, "8", *args, plan=plan)


def _golden_args():
    import importlib.util
    spec = importlib.util.spec_from_file_location("regen", GOLDEN.parents[2] / "benchmarks" / "regen_golden_plans.py")
    regen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regen)
    return regen.golden_args("gpt")


def test_plot_path_is_checked_before_loading(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["explain", "/nonexistent/plan.json", "--plot", str(blocker / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--plot" in err and "is a file" in err and len(err.splitlines()) == 1


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
    (["explain", "{bad}"], "is not JSON"),
    (["explain", "{gold}", "--gpu", "A1000"], "unknown gpu 'A1000'"),
    (["diff", "{gold}", "/nonexistent/b.json"], "cannot read plan file"),
    (["explain", "{notplan}"], "must be a JSON object of a cfp plan"),
    (["explain", "{record}"], "field 'version' must be one of the supported"),
])
def test_bad_inputs_are_one_line_exit_2(tmp_path, capsys, argv, needle):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    notplan = tmp_path / "notplan.json"
    notplan.write_text("[1, 2]")
    record = tmp_path / "record.json"       # an old golden record: model, mesh, settings, choice, strategies
    record.write_text(json.dumps({"model": "gpt", "mesh": "8", "settings": {}, "choice": [0], "strategies": ["x"]}))
    gold = tmp_path / "gold.json"
    shutil.copy(GOLDEN / "gpt_8.json", gold)
    argv = [a.format(bad=bad, gold=gold, notplan=notplan, record=record) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_plan_file_carries_estimates_and_old_files_still_load(tmp_path, gpt_view):
    from cfp.search.plan import PLAN_VERSION, Plan, load_plan
    est = tuple(f.to_dict() for f in gpt_view.figures)
    prof = ({"segment_kind": 0, "choice": [0], "time_s": 1e-3, "memory_bytes": 10, "measured": False,
             "chosen": True},)
    plan = Plan((8,), ("x",), gpt_view.choice, gpt_view.strategies, ("f",) * 9, {}, (), {"estimates_gpu": "H100-SXM"},
                (), PLAN_VERSION, est, prof, (12,) * 9)
    path = plan.save(str(tmp_path / "p.json"))
    assert load_plan(path) == plan
    view = load_view(path)
    assert view.figures == gpt_view.figures and view.profile == prof and view.gpu == "H100-SXM"
    d = json.loads(Path(path).read_text())
    del d["estimates"], d["profile"]
    Path(path).write_text(json.dumps(d))
    assert load_plan(path).estimates == () and load_view(path).figures == ()


def _stack_view(tmp_path, scanned: bool):
    """The explain view of a data-parallel plan of a 3-layer MLP stack, scanned (`nn.scan`) or unrolled."""
    import optax

    from cfp.analysis.analysis import analyze_with_program
    from cfp.analysis.blocks import data_parallel_choice
    from cfp.report.estimates import with_estimates
    from cfp.search.plan import make_plan
    from cfp.sharding.specs import resolve
    from programs import MlpStack, lm_step_problem
    step, args = lm_step_problem(MlpStack(32, 16, 3, scanned), optax.adam(1e-2), 8, 4, 32)
    analysis, _ = analyze_with_program(step, "2x4", *args)
    plan = make_plan(analysis, resolve(analysis, data_parallel_choice(analysis.graph, analysis.blocks), ()))
    path = tmp_path / f"{'scanned' if scanned else 'unrolled'}.json"
    with_estimates(plan, analysis, None, "H100-SXM").save(str(path))
    return analysis, load_view(str(path))


def test_explain_a_scanned_plan_labels_per_iteration_figures_and_totals_every_iteration(tmp_path):
    analysis, view = _stack_view(tmp_path, scanned=True)
    _, twin = _stack_view(tmp_path, scanned=False)
    body = next(s for s in analysis.segments if s.repeat > 1)
    assert body.repeat == 3 and [f.repeat for f in view.figures] == [
        next(s.repeat for s in analysis.segments if b in s.blocks) for b in range(len(view.figures))]
    text = explain_text(view)
    assert "runs" in text and "per iteration" in text and "x3 iterations: total" in text
    # the unrolled twin spells out what the scan runs: its blocks summed equal the scanned plan's blocks
    # summed over their iterations (the same shapes, the same cost model)
    assert all(f.repeat == 1 for f in twin.figures) and "iterations" not in explain_text(twin)
    scanned_total, twin_total = sum(f.step_time_s for f in view.figures), sum(f.time_s for f in twin.figures)
    assert scanned_total == pytest.approx(twin_total, rel=1e-9)
    assert sum(f.time_s for f in view.figures) < 0.8 * twin_total      # one iteration alone is not the step
    assert f"{scanned_total * 1e3:.4f} ms" in text.splitlines()[-1]
    per_iter = sum(f.time_s for f in view.figures if f.repeat > 1)
    assert f"per iteration {per_iter * 1e3:.4f} ms" in text and f"total {per_iter * 3e3:.4f} ms" in text
