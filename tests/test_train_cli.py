"""`cfp train` refuses bad input with one line on stderr and exit code 2, before any training work:
ignored options, bad output paths, a missing, corrupt or differently-configured checkpoint."""
import os

import numpy as np
import pytest

MODEL = ["train", "--model", "llama2", "--num-layers", "2", "--seq-len", "16", "--hetero-configs",
         "[[2,1]]", "--global-batch-size", "4", "--chunks", "2", "--steps", "2"]


def _run(capsys, *extra):
    from cfp.cli.main import main
    code = main(MODEL + list(extra))
    out, err = capsys.readouterr()
    assert "step 1" not in out  # refused before any training step
    return code, err


@pytest.mark.parametrize("extra, message", [
    (["--lr", "nan"], "argument --lr: nan must be a finite number > 0"),
    (["--lr", "0"], "argument --lr: 0 must be a finite number > 0"),
    (["--weight-decay", "inf"], "argument --weight-decay: inf must be a finite number >= 0"),
    (["--verify", "--verify-tol", "nan"], "argument --verify-tol: nan must be a finite number > 0"),
    (["--global-batch-size", "-6"], "-6 must be a positive integer (1 or more)"),
    (["--global-batch-size", "0"], "0 must be a positive integer (1 or more)"),
    (["--steps", "-1"], "argument --steps: -1 must be a positive integer (1 or more)"),
    (["--keep-checkpoints", "-1"], "argument --keep-checkpoints: -1 must be an integer >= 0"),
    (["--seed", "x"], "argument --seed: 'x' is not an integer"),
    (["--checkpoint-every", "1"], "saves nothing without checkpoint_dir (--checkpoint-dir)"),
    (["--checkpoint-dir", "CKPT"], "is unused without checkpoint_every"),
    (["--resume"], "resume (--resume) needs checkpoint_dir"),
    (["--verify-tol", "0.1"], "verify_tol=0.1 (--verify-tol) is unused without verify"),
    (["--data", "synthetic", "--data-path", "x.txt"], "only read with data=files"),
    (["--resume", "--checkpoint-dir", "CKPT/missing"], "resume: no complete checkpoint"),
    (["--schedule", "interleaved:1"], "argument --schedule: schedule interleaved: v=1 virtual stages per stage is "
                                      "invalid (interleaved needs v >= 2)"),
    (["--timeline-dir", "FILE/sub"], "--timeline-dir='FILE/sub' cannot be created: 'FILE' is a file"),
    (["--timeline-dir", "FILE"], "--timeline-dir='FILE' is not a directory"),
    (["--checkpoint-dir", "FILE/x", "--checkpoint-every", "1"], "--checkpoint-dir='FILE/x' cannot be created: "
                                                                "'FILE' is a file"),
    (["--stage-plans", "search", "--checkpoint-dir", "FILE/x"], "--checkpoint-dir='FILE/x' cannot be created"),
])
def test_bad_options_are_one_line_errors(tmp_path, capsys, extra, message):
    (tmp_path / "FILE").write_text("not a directory")
    fix = lambda a: a.replace("CKPT", str(tmp_path / "ck")).replace("FILE", str(tmp_path / "FILE"))
    code, err = _run(capsys, *[fix(a) for a in extra])
    assert code == 2 and err.startswith("cfp train: error: ") and err.count("\n") == 1, err
    assert fix(message) in err, err


def _checkpoint(tmp_path, settings_from, state=None):
    """A checkpoint whose metadata records the settings of ``settings_from`` (CLI options)."""
    from cfp.cli.main import build_parser
    from cfp.runtime.checkpoint import save_checkpoint
    from cfp.cli.train import parse_nested_list
    from cfp.layout import Layout
    from cfp.runtime.training import DataSource, TrainOptions, checkpoint_settings
    a = build_parser().parse_args(settings_from)
    overrides = {"num_layers": a.num_layers, "seq_len": a.seq_len}
    layout = Layout.from_lists(parse_nested_list(a.hetero_configs, "hetero_configs"), [[1, 1]], a.global_batch_size,
                               a.chunks)
    opts = TrainOptions(model=a.model, layout=layout, overrides=overrides, data=DataSource.STDLIB,
                        learning_rate=a.lr, weight_decay=a.weight_decay, seed=a.seed)
    meta = {"settings": checkpoint_settings(opts), "layout": layout.to_json(), "losses": {"1": 4.0}}
    d = tmp_path / "ck"
    save_checkpoint(d, 1, state or {"w": np.arange(5000, dtype=np.float32)}, meta)
    return d


@pytest.mark.parametrize("change, message", [
    (["--seq-len", "32"], "was written with overrides={'num_layers': 2, 'seq_len': 16}, this run "
                          "has overrides={'num_layers': 2, 'seq_len': 32}"),
    (["--seed", "3"], "was written with seed=0, this run has seed=3"),
    (["--global-batch-size", "8"], "was written with batch_rows=4, this run has batch_rows=8"),
    (["--lr", "0.01"], "was written with learning_rate=0.001"),
])
def test_resume_refuses_other_settings(tmp_path, capsys, change, message):
    d = _checkpoint(tmp_path, MODEL)
    code, err = _run(capsys, "--resume", "--checkpoint-dir", str(d), *change)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_resume_refuses_state_of_another_model(tmp_path, capsys):
    d = _checkpoint(tmp_path, MODEL)  # same settings, but the state is not this model's
    code, err = _run(capsys, "--resume", "--checkpoint-dir", str(d))
    assert code == 2 and err.count("\n") == 1 and "has no leaf" in err, err


def test_resume_refuses_a_corrupt_checkpoint(tmp_path, capsys):
    d = _checkpoint(tmp_path, MODEL)
    chunk = max((os.path.join(r, f) for r, _, fs in os.walk(d / "1" / "state") for f in fs),
                key=os.path.getsize)
    data = bytearray(open(chunk, "rb").read())
    data[4096:8192] = bytes(b ^ 0xFF for b in data[4096:8192])
    open(chunk, "wb").write(bytes(data))
    code, err = _run(capsys, "--resume", "--checkpoint-dir", str(d))
    assert code == 2 and err.count("\n") == 1, err
    assert "cannot be read" in err or "does not match the checksum" in err, err


def test_stage_plan_search_keeps_its_plans_under_checkpoint_dir_alone(tmp_path, capsys, monkeypatch):
    """--stage-plans search with --checkpoint-dir and no --checkpoint-every: the directory reaches the stage-plan
    step (which saves the plans in DIR/stage_plans) instead of being refused as unused."""
    import cfp.runtime.stage.plan_sources as sp
    from cfp.errors import CfpError
    from cfp.runtime.stage.plans import StagePlanMode
    seen = {}

    def record(request):
        seen.update(mode=request.options.mode, checkpoint_dir=request.checkpoint_dir)
        raise CfpError("stopped by the test")      # the search itself is tested in test_stage_plans.py
    monkeypatch.setattr(sp.PLAN_SOURCES[StagePlanMode.SEARCH], "stage_plans", record)
    code, err = _run(capsys, "--stage-plans", "search", "--checkpoint-dir", str(tmp_path / "ck"))
    assert code == 2 and "stopped by the test" in err, err
    assert seen == {"mode": StagePlanMode.SEARCH, "checkpoint_dir": str(tmp_path / "ck")}


def test_keep_checkpoints_prunes_through_training_and_resume_continues(tmp_path, capsys):
    """--keep-checkpoints 2 over 3 saved steps leaves steps 2 and 3; --resume continues from step 3."""
    from cfp.cli.main import main
    from cfp.runtime.checkpoint import all_steps
    d = tmp_path / "ck"
    base = [a if a != "2" or i != MODEL.index("--steps") + 1 else "3" for i, a in enumerate(MODEL)]
    args = base + ["--data", "synthetic", "--checkpoint-dir", str(d), "--checkpoint-every", "1",
                   "--keep-checkpoints", "2"]
    assert main(args) == 0
    assert all_steps(d) == [2, 3] and sorted(os.listdir(d)) == ["2", "3"]
    capsys.readouterr()
    assert main([a if a != "3" else "4" for a in args] + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {d} step 3" in out and "step 4 loss" in out and "step 3 loss" not in out
    assert all_steps(d) == [3, 4]


def test_cli_defaults_are_the_api_defaults():
    """One default per shared option: `cfp train`, `cfp plan` and `cfp data train` agree with each other and
    with TrainOptions / PlannerOptions."""
    from cfp.cli import common
    from cfp.cli.main import build_parser
    from cfp.planner.options import PlannerOptions
    from cfp.runtime.training import TrainOptions
    p = build_parser()
    train = p.parse_args(["train"])
    plan = p.parse_args(["plan", "--cluster", "c.yaml", "--model", "gpt"])
    data = p.parse_args(["data", "train", "--model", "gpt", "--input", "stdlib"])
    # `cfp train --schedule` unset is None: a layout file's per-pipeline schedules, else the default
    assert train.schedule is None
    assert plan.schedule == TrainOptions.schedule.value == common.DEFAULT_SCHEDULE
    assert PlannerOptions.__dataclass_fields__["schedule"].default.value == common.DEFAULT_SCHEDULE
    assert train.schedule_tables == TrainOptions.tables.value
    assert train.steps == data.steps == TrainOptions.steps == common.DEFAULT_STEPS
    assert train.lr == data.lr == TrainOptions.learning_rate
    assert train.weight_decay == TrainOptions.weight_decay and train.seed == data.seed == TrainOptions.seed
    # `cfp plan --config` defaults to None so that one given beside a factory is refused; unset, it is the zoo's
    assert plan.config is None and train.config == data.config == TrainOptions.config_name == common.DEFAULT_CONFIG
    assert train.keep_checkpoints == TrainOptions.keep_checkpoints


def test_a_layout_file_runs_the_schedules_planned_for_its_pipelines(tmp_path, capsys):
    """`cfp plan` prices each pipeline with its own schedule (virtual stages included); `cfp train --layout` runs
    each pipeline's, v and all (the file's `schedule` holds the name only); `--schedule` overrides them all."""
    from cfp.cli.main import build_parser
    from cfp.cli.train import layout_from_args
    from cfp.layout import Layout
    from cfp.planner.layout_file import LayoutFile, write_layout_file
    from cfp.schedules.registry import ScheduleName
    layout = Layout.from_lists([[1, 1, 1], [1]], [[2, 2, 2], [6]], [6, 2], [3, 2])
    for schedules in (("interleaved:3", "1f1b"), ("interleaved:3", "interleaved:3")):
        path = str(tmp_path / "l.json")
        write_layout_file(path, LayoutFile("llama2", "tiny", {"num_layers": 6}, ScheduleName.INTERLEAVED, layout,
                                           {}, {}, schedules))
        args = build_parser().parse_args(["train", "--layout", path])
        assert layout_from_args(args)[2] == layout
        assert args.schedule == "interleaved:3" and args.filed_schedules == schedules
        given = build_parser().parse_args(["train", "--layout", path, "--schedule", "gpipe"])
        layout_from_args(given)
        assert given.schedule == "gpipe" and not getattr(given, "filed_schedules", ())
