"""Each pipeline runs the schedule its plan gave it (issue 40 item 3): its own table, the gradient synchronised
across pipelines on different schedules, verified against one device; --schedule overrides them all."""
import json

import pytest

from cfp.layout import Layout
from cfp.runtime.engine import HeteroTrainer
from cfp.schedules.registry import Phase

from test_runtime import check_gradients, programs, tiny

LAYOUT = Layout.from_lists([[1, 1], [1, 1]], [[2, 2], [1, 3]], [4, 4], [4, 2])


def test_each_pipeline_runs_its_own_table_and_the_step_is_the_single_device_one():
    cfg = tiny(4)
    cache = programs(cfg)
    trainer = HeteroTrainer(cache.model, None, LAYOUT, ("zb-h1", "gpipe"), cache=cache)
    assert [str(s) for s in trainer.specs] == ["zb-h1", "gpipe"]
    phases = {q: {a.phase for a in trainer.order if a.pipeline == q} for q in (0, 1)}
    assert phases[0] == {Phase.FWD, Phase.BWD_INPUT, Phase.BWD_WEIGHT}
    assert phases[1] == {Phase.FWD, Phase.BWD}
    assert trainer.table(0).name == "zb-h1" and trainer.table(1).name == "gpipe"
    check_gradients(trainer.init(), "llama2", cfg)
    trainer.set_schedule("1f1b")            # one schedule for every pipeline again
    assert {str(s) for s in trainer.specs} == {"1f1b"}
    with pytest.raises(Exception, match="3 schedules .* for 2 pipelines"):
        trainer.set_schedule(("zb-h1", "gpipe", "1f1b"))


def _layout_file(path, schedules):
    doc = {"format": "cfp-layout/2", "model": "llama2", "config": "tiny", "overrides": {"num_layers": 4},
           "schedule": schedules[0], "layout": LAYOUT.to_json(), "estimate": {}, "cluster": {},
           "schedules": list(schedules)}
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("override", [None, "1f1b"])
def test_a_layout_files_schedules_train_and_verify(tmp_path, capsys, override):
    from cfp.cli.main import main
    path = _layout_file(tmp_path / "two.json", ["zb-h1", "gpipe"])
    argv = ["train", "--layout", path, "--steps", "2", "--verify"] + (["--schedule", override] if override else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    if override:
        assert "schedule 1f1b;" in out
    else:
        assert "schedule zb-h1 (pipeline 0), gpipe (pipeline 1);" in out
    assert "verify: max relative error" in out and "(ok" in out
