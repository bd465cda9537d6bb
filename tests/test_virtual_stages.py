"""Interleaved 1F1B and ZB-V on the runtime (virtual stages run as an expanded execution layout): the single-device
gradient, losses and parameters, with uneven stages, a virtual stage of no layers, a TP-2 stage and two pipelines;
kept activations measured == predicted per stage every step; each virtual stage on its own stage's devices."""
import numpy as np
import pytest

from cfp.errors import ConfigError
from cfp.layout import Layout
from cfp.runtime.vstages import expand
from cfp.schedules.registry import ScheduleSpec
from test_runtime import check_gradients, check_steps, make_trainer, tiny

VSTAGE_LAYOUTS = [  # hetero_configs, layer_partitions, global batch, chunks
    # the acceptance's stages: stage 3 holds one layer, so one of its virtual stages holds none (interleaved: the
    # last, head and loss only; ZB-V: a middle one that passes its input on)
    pytest.param([[1, 1, 1, 1]], [[3, 2, 2, 1]], [8], [4], id="3-2-2-1"),
    # a TP-2 stage, two pipelines of other boundaries, a one-layer stage (zero-layer chunk) in each
    pytest.param([[2, 1], [1, 1]], [[2, 1], [1, 2]], [4, 4], [2, 2], id="tp2-1+1-1"),
]


def test_expanded_layout_places_each_virtual_stage_on_its_stage():
    layout = Layout.from_lists([[1, 2, 1]], [[3, 2, 1]], [6], [3])
    inter = expand(layout, ScheduleSpec.parse("interleaved:2"))
    assert inter.placements == ((0, 1, 2, 0, 1, 2),)
    assert [s.layers for s in inter.run.pipelines[0].stages] == [2, 1, 1, 1, 1, 0]
    assert [s.devices for s in inter.run.pipelines[0].stages] == [(0,), (1, 2), (3,), (0,), (1, 2), (3,)]
    zbv = expand(layout, ScheduleSpec.parse("zb-v"))
    assert zbv.placements == ((0, 1, 2, 2, 1, 0),)
    assert [s.layers for s in zbv.run.pipelines[0].stages] == [2, 1, 1, 0, 1, 1]
    assert [zbv.stage_of((0, c)) for c in range(6)] == [(0, 0), (0, 1), (0, 2), (0, 2), (0, 1), (0, 0)]
    assert expand(layout, ScheduleSpec.parse("1f1b")).run is layout


@pytest.mark.parametrize("text, message", [
    ("interleaved:1", "interleaved needs v >= 2"), ("interleaved:x", "not a number of virtual stages"),
    ("zb-v:3", "v=3 virtual stages per stage is invalid"), ("1f1b:2", "it holds exactly 1")])
def test_bad_virtual_stages_are_one_line_errors(text, message, capsys):
    with pytest.raises(ConfigError, match=message):
        ScheduleSpec.parse(text)
    from cfp.cli.main import main
    code = main(["train", "--model", "llama2", "--schedule", text])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and message in err, err


def _check_devices(trainer) -> None:
    """Every expanded stage's parameters live on the devices of the stage its virtual stage is placed on."""
    import jax
    for (q, c), params in trainer.params.items():
        want = set(trainer.layout.pipelines[q].stages[trainer.vstages.placements[q][c]].devices)
        prog = trainer.programs[(q, c)]
        assert {d.id for d in prog.devices} == want, (q, c)
        for leaf in jax.tree_util.tree_leaves(params):
            assert {d.id for d in leaf.sharding.device_set} == want, (q, c)


@pytest.mark.parametrize("tps, parts, gbs, chunks", VSTAGE_LAYOUTS)
def test_virtual_stage_schedules_match_single_device(tps, parts, gbs, chunks):
    layout = Layout.from_lists(tps, parts, gbs, chunks)
    cfg = tiny(layout.num_layers)
    trainer = make_trainer(cfg, layout, "interleaved:2")
    kept = {}
    for schedule in ("interleaved:2", "zb-v"):     # switching rebuilds the programs for the other placement
        trainer.set_schedule(schedule)
        assert trainer.run_layout.pipelines[0].num_stages == 2 * layout.pipelines[0].num_stages
        assert any(st.stage.layers == 0 for st in trainer.run_layout.placed)
        check_gradients(trainer.init(), "llama2", cfg)
        _check_devices(trainer)
        trainer.init()
        kept[schedule] = check_steps(trainer, "llama2", cfg)    # kept measured == predicted every step
        assert set(kept[schedule]) == {st.key for st in layout.placed}    # per stage, not per virtual stage
    # ZB-V keeps B's stash until W: on every stage past the first, more than interleaved's inputs only
    for q, pipe in enumerate(layout.pipelines):
        for s in range(1, pipe.num_stages):
            assert kept["zb-v"][(q, s)] > 0 and kept["interleaved:2"][(q, s)] > 0


def test_checkpointed_state_is_the_same_tree_under_virtual_stages():
    """The layout-independent state (what checkpoints hold) taken under ZB-V places onto 1F1B's stages unchanged,
    and back: parameters are per layer, whatever the virtual stages."""
    layout = Layout.from_lists([[1, 1, 1]], [[2, 2, 1]], [3], [3])
    cfg = tiny(layout.num_layers)
    trainer = make_trainer(cfg, layout, "zb-v").init()
    params, opt, step = trainer.state()
    other = make_trainer(cfg, layout, "1f1b").load_state(params, opt, step)
    import jax
    for a, b in zip(jax.tree_util.tree_leaves(other.state()[:2]), jax.tree_util.tree_leaves((params, opt))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree_util.tree_structure(other.state()[0]) == jax.tree_util.tree_structure(params)


@pytest.mark.parametrize("schedule", ["zb-v"])     # split backward, V placement (the run test below: interleaved)
def test_a_generated_table_trains_like_one_device_within_the_patterns_memory(schedule):
    """The table generated for uneven stage times (the generator's, not the fixed pattern) runs on the engine: the
    single-device gradient, losses and parameters, kept activations measured == predicted for that table and
    within what the fixed pattern keeps per device; a table of other virtual stages or over that memory is
    refused."""
    from cfp.runtime.engine import HeteroTrainer
    from cfp.schedules.actions import peak_kept
    from cfp.schedules.registry import SCHEDULES, ScheduleName
    from cfp.schedules.simulate import ActionCosts, simulate
    from test_runtime import batches, programs
    layout = Layout.from_lists([[1, 1, 1, 1]], [[3, 2, 2, 1]], [8], [4])
    cfg = tiny(layout.num_layers)
    c = programs(cfg, "llama2")   # the example batch gives the kept bytes the memory limit is in
    trainer = HeteroTrainer(c.model, None, layout, schedule, cache=c, example_batch=batches("llama2", cfg, 8)[0])
    pattern = trainer.table(0)
    costs = ActionCosts.per_stage([3.0, 2.0, 2.0, 1.0], [3.0, 2.0, 2.0, 1.0], [2.4, 1.6, 1.6, 0.8],
                                  pattern.placement)
    (table, sim), = trainer.generated_tables({0: costs}).values()
    assert table.actions != pattern.actions and sim.makespan < simulate(pattern, costs).makespan
    kept = trainer.kept_bytes(0)
    before = trainer.kept_prediction()
    trainer.use_tables({0: table})
    assert trainer.table(0) is table and trainer.table(0, 2) is not table   # another count: the pattern
    after = trainer.kept_prediction()
    assert [after[(0, s)] for s in range(4)] == [int(x) for x in peak_kept(table, kept)]
    assert all(after[k] <= before[k] for k in before)
    check_gradients(trainer.init(), "llama2", cfg)
    trainer.init()
    check_steps(trainer, "llama2", cfg)       # kept measured == the generated table's prediction every step
    other = SCHEDULES[ScheduleName.ZB_H1].pattern(4, 4)     # the same actions, placed in a line, not a V
    with pytest.raises(ConfigError, match="places its virtual stages"):
        trainer.use_tables({0: other})
    loose, _ = trainer.spec.entry.generated(4, 4, costs, trainer.spec.v, [1e30] * 4, kept)
    if any(a > b for a, b in zip(peak_kept(loose, kept), peak_kept(pattern, kept))):
        with pytest.raises(ConfigError, match="at its peak"):
            trainer.use_tables({0: loose})


@pytest.mark.parametrize("schedule", ["interleaved:2"])   # whole backward, virtual stages in a loop
def test_a_run_measures_its_stages_then_trains_on_the_generated_table(tmp_path, schedule):
    """`run_training` with ``tables="generated"`` (the default) times a pass of the first batch, runs the table
    generated from it (what it logs), reports the replay on the table that ran and verifies against one device;
    ``tables="pattern"`` keeps the fixed pattern and measures nothing first."""
    from cfp.models import get_config
    from cfp.runtime.training import DataSource, TrainOptions, run_training
    from test_runtime import LR, RUN_OVERRIDES, WD, programs
    cache = programs(get_config("llama2", "tiny", **RUN_OVERRIDES))   # both runs build the same stage programs
    layout = Layout.from_lists([[1, 1]], [[1, 1]], [4], [4])
    runs = {}
    for tables in ("generated", "pattern"):
        said = []
        opts = TrainOptions(model="llama2", layout=layout, overrides=RUN_OVERRIDES, steps=2, data=DataSource.STDLIB,
                            learning_rate=LR, weight_decay=WD, schedule=schedule, verify=True, tables=tables,
                            timeline_dir=str(tmp_path / tables))
        runs[tables] = run_training(opts, log=lambda *a, **k: said.extend(a), cache=cache)
        assert "attention: xla (dense; cpu devices)" in said     # the header names what the stages run
        adopted = [line for line in said if line.startswith("pipeline 0 runs ")]
        ran = [line for line in said if line.startswith("pipeline 0 ran ")]
        assert runs[tables].verify_ok, said
        if ran:    # measured in full: the replay is drawn beside it, each action as long as it was measured
            from references import load_timeline
            measured = load_timeline(tmp_path / tables / "timeline.json").events
            replay = load_timeline(tmp_path / tables / "simulated.json").events
            key = lambda e: (e.pipeline, e.stage, e.microbatch, e.phase)
            assert sorted(map(key, replay)) == sorted(map(key, measured))
            took = {key(e): e.duration for e in measured}
            assert all(e.duration == pytest.approx(took[key(e)], rel=1e-5) for e in replay)
            assert (tmp_path / tables / "simulated.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if tables == "generated":
            assert len(adopted) == 1 and "from the median F/B/W of 3 passes of the first batch" in adopted[0], said
            own = "its fixed pattern" in adopted[0]
            assert len(ran) in (0, 1) and all(("ran its fixed pattern" in r) == own for r in ran), said
        else:
            assert not adopted and all("ran its fixed pattern" in r for r in ran), said
    # the first step's loss: the same batch and parameters (summed in another order where the tables differ)
    assert runs["generated"].losses[1] == pytest.approx(runs["pattern"].losses[1], rel=1e-6)
    with pytest.raises(ConfigError, match="tables='fixed' is invalid"):
        TrainOptions(model="llama2", layout=layout, tables="fixed")
