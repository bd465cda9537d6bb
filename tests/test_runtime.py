"""Heterogeneous 3D-parallel runtime: layout validation, schedules, equivalence with one device,
token-weighted sync, checkpoint resume (also onto another layout), timeline, CLI errors."""
import json

import numpy as np
import pytest

from cfp.cli.train import parse_nested_list
from cfp.errors import ConfigError
from cfp.layout import Layout
from cfp.schedules.registry import (SCHEDULES, Phase, ScheduleName, global_order, gpipe,
                                    one_f_one_b)

# ----------------------------------------------------------------------------- layout


def test_from_lists_pads_cuts_and_packs_devices():
    lay = Layout.from_lists([[2, 1, 1], [4]], [[2, 1, 1], [4]], [6], [3, 1, 7])
    assert [p.batch for p in lay.pipelines] == [6, 6]               # padded with the last value
    assert [p.chunks for p in lay.pipelines] == [3, 1]              # cut
    assert [s.devices for s in lay.placed] == [(0, 1), (2,), (3,), (4, 5, 6, 7)]
    assert [list(s.layer_range) for s in lay.placed_in(0)] == [[0, 1], [2], [3]]
    assert lay.place((0, 0)).module_names() == ["embed", "layers_0", "layers_1"]
    assert lay.place((1, 0)).module_names()[-1] == "head"
    assert lay.place((0, 2)).key == (0, 2) and lay.place((0, 2)).is_last and not lay.place((0, 1)).is_last
    assert lay.num_devices == 8 and lay.global_batch == 12 and lay.batch_offsets() == [0, 6]
    custom = Layout.from_lists([[1, 1]], [[1, 1]], 2, 1, devices_id=parse_nested_list("[[[5],[3]],]", "devices_id"))
    assert [s.devices for s in custom.placed] == [(5,), (3,)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(hetero_configs="[[2,1]", layer_partitions="[[1,1]]"), "--hetero-configs='[[2,1]' is not a list literal"),
    (dict(hetero_configs="[[2,0]]", layer_partitions="[[1,1]]"), "hetero_configs[0][1]=0"),
    (dict(hetero_configs="[[2,1]]", layer_partitions="[[1,1],[2]]"), "has 2 pipelines"),
    (dict(hetero_configs="[[2,1]]", layer_partitions="[[2]]"), "has 1 stages"),
    (dict(hetero_configs="[[1],[1]]", layer_partitions="[[2],[3]]"), "pipelines hold different numbers of layers [2, 3]"),
    (dict(hetero_configs="[[1]]", layer_partitions="[[2]]", global_batch_size=[6], chunks=[4]),
     "pipeline 0: batch=6 is not a positive multiple of chunks=4"),
    (dict(hetero_configs="[[1]]", layer_partitions="[[2]]", global_batch_size=[-1]),
     "global_batch_size[0]=-1"),
    (dict(hetero_configs="[[2]]", layer_partitions="[[2]]", devices_id="[[[0]]]"),
     "devices_id[0][0]=[0] has 1 devices but the stage's TP degree is hetero_configs[0][0]=2"),
    (dict(hetero_configs="[[1],[1]]", layer_partitions="[[2],[2]]", devices_id="[[[0]],[[0]]]"),
     "device 0 is used by stage (0, 0) and stage (1, 0)"),
])
def test_invalid_layouts_name_the_value(kwargs, message):
    args = dict(global_batch_size=2, chunks=1)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=None) as e:
        lists = {k: parse_nested_list(v, k) if isinstance(v, str) else v for k, v in args.items()}  # as the CLI
        Layout.from_lists(lists.pop("hetero_configs"), lists.pop("layer_partitions"), **lists)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_validate_for_model():
    from cfp.models import get_config
    cfg = get_config("llama2", "tiny", num_layers=4)  # 4 heads
    heads = (cfg.num_heads, cfg.num_kv_heads)
    with pytest.raises(ConfigError, match=r"pipeline 0 stage 0: TP degree 8 must divide num_heads=4"):
        Layout.from_lists([[8]], [[4]]).validate_for(cfg.num_layers, 8, heads)
    with pytest.raises(ConfigError, match="num_layers=4"):
        Layout.from_lists([[1]], [[3]]).validate_for(cfg.num_layers, 8, heads)
    with pytest.raises(ConfigError, match="uses device 9"):
        Layout.from_lists([[1]], [[4]], devices_id=[[[9]]]).validate_for(cfg.num_layers, 8, heads)


def test_cli_invalid_config_is_one_line_exit_2(capsys):
    from cfp.cli.main import main
    code = main(["train", "--model", "llama2", "--num-layers", "4", "--hetero-configs", "[[3,1]]",
                 "--layer-partitions", "[[2,2]]", "--data", "synthetic"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "pipeline 0 stage 0: TP degree 3 must divide num_heads=4" in err

# ----------------------------------------------------------------------------- schedules


def test_schedules_are_data_and_respect_dependencies():
    assert {n for n, s in SCHEDULES.items() if s.runs_on_engine} == set(ScheduleName)   # virtual stages too
    f = lambda m, s=0: (Phase.FWD, m, s)
    b = lambda m, s=0: (Phase.BWD, m, s)
    assert gpipe(2, 2)[0] == [f(0), f(1), b(0), b(1)]
    acts = one_f_one_b(3, 4)
    assert acts[0] == [f(0), f(1), f(2), b(0), f(3), b(1), b(2), b(3)]
    assert acts[2] == [f(0, 2), b(0, 2), f(1, 2), b(1, 2), f(2, 2), b(2, 2), f(3, 2), b(3, 2)]
    for s, stage in enumerate(acts):  # 1F1B keeps at most p - s micro-batches in flight
        live = peak = 0
        for a in stage:
            live += 1 if a.phase is Phase.FWD else -1
            peak = max(peak, live)
        assert peak <= 3 - s
    order = global_order([one_f_one_b(3, 4), gpipe(1, 2)])
    done = set()
    for g in order:
        if g.phase is Phase.FWD and g.stage > 0:
            assert (g.pipeline, g.stage - 1, Phase.FWD, g.microbatch) in done
        if g.phase is Phase.BWD and g.pipeline == 0 and g.stage < 2:
            assert (g.pipeline, g.stage + 1, Phase.BWD, g.microbatch) in done
        done.add((g.pipeline, g.stage, g.phase, g.microbatch))
    assert len(order) == 3 * 8 + 4
    with pytest.raises(ConfigError, match="unknown schedule 'zb'; valid choices: gpipe, 1f1b, interleaved, zb-h1, zb-v"):
        ScheduleName.parse("zb")

# ----------------------------------------------------------------------------- equivalence

STEPS = 3
_REF = {}

# Tolerances from measured float32 reordering noise (tiny llama2 configs below, jax 0.10 XLA:CPU on
# x86-64 with AVX-512, and with XLA_FLAGS=--xla_cpu_max_isa=AVX2 / SSE4_2: the same figures):
# * gradients: summing the same loss in another order (micro-batched vs whole batch on one device)
#   moves a leaf's gradient by up to 5.7e-7 (normwise); the engine (per-stage vjp, TP all-reduces)
#   vs the micro-batched one-device reference differs by up to 3.6e-7.  GRAD_TOL is ~7x that noise;
#   a dropped, repeated or mis-weighted micro-batch or pipeline is an error of order 1e-1.
# * after 3 AdamW steps the whole-tree error vs the micro-batched reference is <= 9.4e-7 (two
#   one-device references that only differ in summation order: 1.0e-6).  Adam turns the noise of a
#   near-zero gradient element into a step of order lr, so per-leaf or elementwise bounds depend on
#   the machine; the whole-tree norm does not.  The updates move the parameters by 2.2e-2, 2000x
#   PARAM_TOL (checked in each test, and a skipped update fails: test_skipped_update_is_caught).
# * losses: engine vs micro-batched reference <= 5.8e-8, micro-batched vs whole batch 2.3e-7.
GRAD_TOL = 4e-6
PARAM_TOL = 1e-5
LOSS_RTOL = 2e-6
# AdamW's decoupled weight decay moves the parameters by lr * WD * p per step: over STEPS steps ~3e-4 of their
# norm, 30x PARAM_TOL, so an engine that drops (or mis-scales) the decay fails the parameter check.  The
# references build their optimizer from optax directly (cfp.runtime.verify), never from the engine.
LR, WD = 1e-3, 0.1
OPT = dict(learning_rate=LR, weight_decay=WD)
_SHARED_CACHE = {}


def programs(cfg, model="llama2"):
    """One compile cache per config for this file's trainers (a cache holds one model and optimizer): tests of the
    same config and layout share compiled programs (the engine's own cache is per trainer)."""
    if (model, cfg) not in _SHARED_CACHE:
        from cfp.models.layered import zoo_model
        from cfp.runtime.engine import adamw
        from cfp.runtime.stage.cache import CompileCache
        _SHARED_CACHE[(model, cfg)] = CompileCache(zoo_model(model, cfg, 0), adamw(LR, WD))
    return _SHARED_CACHE[(model, cfg)]


def make_trainer(cfg, layout, schedule="gpipe", model="llama2"):
    """A trainer of the zoo model's `LayeredModel` (parameters of seed 0) with AdamW(LR, WD), through `programs`."""
    from cfp.runtime.engine import HeteroTrainer
    c = programs(cfg, model)
    return HeteroTrainer(c.model, None, layout, schedule, cache=c)


def initial_state(model, cfg):
    """The zoo model's layered parameters of seed 0 and their AdamW state (host numpy)."""
    import jax
    from cfp.runtime.engine import adamw
    p = jax.tree_util.tree_map(np.asarray, programs(cfg, model).model.params)
    return p, adamw(LR, WD).init(p)


def tiny(num_layers, model="llama2", **kw):
    from cfp.models import get_config
    base = dict(num_layers=num_layers, seq_len=8, vocab_size=64, hidden_size=32)
    if model == "llama2":
        base["ffn_size"] = 64
    base.update(kw)
    return get_config(model, "tiny", **base)


def batches(model, cfg, rows):
    import jax
    from cfp.models import make_batch
    return [jax.tree_util.tree_map(np.asarray, make_batch(model, cfg, rows, 100 + i))
            for i in range(STEPS)]


def reference(model, cfg, rows):
    """Single-device losses and params after STEPS steps of cfp.models.train_step (cached)."""
    key = (model, cfg, rows)
    if key not in _REF:
        from cfp.runtime.verify import replay, zoo_reference
        p, o = initial_state(model, cfg)
        _REF[key] = replay(*zoo_reference(model, cfg, LR, WD), p, o, batches(model, cfg, rows))
    return _REF[key]


def microbatched_reference(model, cfg, layout):
    """(initial params, losses, final params, per-step gradients) of one device accumulating the
    layout's micro-batches in the engine's order (cached)."""
    key = (model, cfg, layout)
    if key not in _REF:
        from cfp.runtime.verify import microbatched_replay
        p, o = initial_state(model, cfg)
        _REF[key] = (p,) + microbatched_replay(
            model, cfg, layout, p, o, batches(model, cfg, layout.global_batch),
            learning_rate=LR, weight_decay=WD)
    return _REF[key]


def check_gradients(trainer, model, cfg):
    """The engine's gradient before the optimizer, leaf by leaf, vs the micro-batched reference."""
    from cfp.runtime.verify import leaf_errors
    _, _, _, ref_grads = microbatched_reference(model, cfg, trainer.layout)
    grads, _ = trainer.gradients(batches(model, cfg, trainer.layout.global_batch)[0])
    errs = leaf_errors(grads, ref_grads[0])
    worst = max(errs, key=errs.get)
    assert errs[worst] < GRAD_TOL, (worst, errs[worst])


def check_steps(trainer, model, cfg) -> dict:
    """STEPS AdamW steps: losses and whole-tree parameters vs the micro-batched reference, and each step's
    activations kept between actions (per stage, read from the dispatcher's buffers) equal to its schedule's
    prediction; returns the last step's."""
    import jax
    from cfp.runtime.verify import loss_error, tree_error
    from references import identical_across_pipelines
    p0, ref_losses, ref_params, _ = microbatched_reference(model, cfg, trainer.layout)
    losses = []
    for b in batches(model, cfg, trainer.layout.global_batch):
        stats = trainer.step(b)
        losses.append(stats.loss)
        like = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), trainer.micro_batches(b)[0][0])
        assert stats.kept_peak == trainer.kept_prediction(like), trainer.schedule
    assert loss_error(losses, ref_losses) < LOSS_RTOL
    assert tree_error(trainer.state()[0], ref_params) < PARAM_TOL
    assert tree_error(p0, ref_params) > 1000 * PARAM_TOL  # the check can see a missing update
    assert identical_across_pipelines(trainer)
    return stats.kept_peak


def check_kept_counts(layout, kept: dict) -> None:
    """The activations each stage keeps, in micro-batches' residuals: GPipe all m of them, 1F1B at most p - s on
    stage s (the memory it exists to save); the first stage keeps its forward's residuals too."""
    for q, pipe in enumerate(layout.pipelines):
        p, m = pipe.num_stages, pipe.chunks
        for s in range(p):
            unit = kept["gpipe"][(q, s)] // m         # one micro-batch's residuals on stage s, bytes per device
            assert unit > 0 and kept["gpipe"][(q, s)] == m * unit, (q, s)
            assert kept["1f1b"][(q, s)] == min(p - s, m) * unit, (q, s)


LAYOUTS = [  # hetero_configs, layer_partitions, global batch, chunks
    pytest.param([[2, 1, 1], [4]], [[1, 1, 1], [3]], [6, 2], [3, 1], id="2-1-1+4"),
    pytest.param([[4], [2], [1], [1]], [[1], [1], [1], [1]], [4, 2, 1, 1], [2, 1, 1, 1],
                 id="4+2+1+1"),
    pytest.param([[2, 1]], [[1, 1]], [4], [2], id="tp2-into-tp1"),
    pytest.param([[1] * 8], [[1] * 8], [8], [4], id="8-stages", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tps, parts, gbs, chunks", LAYOUTS)
def test_matches_single_device_gpipe_and_1f1b(tps, parts, gbs, chunks):
    layout = Layout.from_lists(tps, parts, gbs, chunks)
    cfg = tiny(layout.num_layers)
    trainer = make_trainer(cfg, layout)
    check_gradients(trainer.init(), "llama2", cfg)
    kept = {}
    for schedule in ("zb-h1", "gpipe", "1f1b"):  # F and whole-backward programs are schedule-independent
        trainer.set_schedule(schedule)
        if schedule == "zb-h1":     # B and W: the gradient before the optimizer too
            check_gradients(trainer.init(), "llama2", cfg)
        trainer.init()
        kept[schedule] = check_steps(trainer, "llama2", cfg)
    check_kept_counts(layout, kept)


def test_skipped_update_is_caught(monkeypatch):
    """The parameter checks above fail when pipeline 0's update of one stage is skipped (its values are what
    ``state()`` returns) and when a stage of pipeline 1 misses pipeline 0's new parameters (the cross-pipeline
    check)."""
    import cfp.runtime.engine as engine
    from cfp.runtime.verify import tree_error
    from references import identical_across_pipelines
    layout = Layout.from_lists([[2, 1, 1], [4]], [[1, 1, 1], [3]], [6, 2], [3, 1])
    cfg = tiny(3)
    for skipped in ((0, 1), (1, 0)):
        trainer = make_trainer(cfg, layout).init()
        prog = trainer.programs[skipped]
        n = len(__import__("jax").tree_util.tree_leaves(prog.params_like))
        with monkeypatch.context() as m:
            if skipped[0] == 0:
                m.setattr(prog, "apply_update", lambda g, o, p, glob: (p, o, np.ones((2, n), bool)))
            else:
                real = engine.broadcast_params

                def broadcast(layout, programs, params, *a, _real=real):
                    kept = params[skipped]
                    _real(layout, programs, params, *a)
                    params[skipped] = kept
                m.setattr(engine, "broadcast_params", broadcast)
            with pytest.raises(AssertionError):
                check_steps(trainer, "llama2", cfg)
        _, _, ref_params, _ = microbatched_reference("llama2", cfg, layout)
        if skipped[0] == 0:
            assert tree_error(trainer.state()[0], ref_params) > 10 * PARAM_TOL
        else:
            assert not identical_across_pipelines(trainer)


def test_gradient_is_token_weighted():
    """Pipelines [[2,1,1],[4]] with batches 6 and 2: the gradient equals the single-device gradient
    of the concatenated batch (the seed's equal weighting of pipelines is a different gradient)."""
    import jax
    from cfp.runtime.verify import zoo_reference
    cfg = tiny(3)  # same programs as the 2-1-1+4 equivalence test: no new compile
    layout = Layout.from_lists([[2, 1, 1], [4]], [[1, 1, 1], [3]], [6, 2], [3, 1])
    trainer = make_trainer(cfg, layout).init()
    batch = batches("llama2", cfg, 8)[0]
    grads, loss = trainer.gradients(batch)
    params = trainer.state()[0]
    lf = zoo_reference("llama2", cfg, LR, WD)[0]
    ref_loss, ref = jax.value_and_grad(lf)(params, batch)
    assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        r = np.asarray(r)
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())
    # the seed's rule (mean of per-pipeline mean losses) is a different, wrong gradient
    half = lambda lo, hi: {k: v[lo:hi] for k, v in batch.items()}
    seed = jax.grad(lambda p: 0.5 * lf(p, half(0, 6)) + 0.5 * lf(p, half(6, 8)))(params)
    assert not np.allclose(seed["first"]["token"]["embedding"], grads["first"]["token"]["embedding"], rtol=1e-3)


@pytest.mark.slow
def test_bf16_compute_with_f32_master_weights():
    import jax
    from cfp.runtime.verify import tree_error
    cfg = tiny(2, dtype="bfloat16")
    layout = Layout.from_lists([[2, 1]], [[1, 1]], [4], [2])
    trainer = make_trainer(cfg, layout, "1f1b").init()
    ref_losses, ref_params = reference("llama2", cfg, 4)
    losses = [trainer.step(b).loss for b in batches("llama2", cfg, 4)]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    params = trainer.state()[0]
    assert all(l.dtype == np.float32 for l in jax.tree_util.tree_leaves(params))
    assert tree_error(params, ref_params) < 5e-2

# ----------------------------------------------------------------------------- training loop


RUN_OVERRIDES = dict(num_layers=2, seq_len=16, hidden_size=32, ffn_size=64)


def _opts(tmp_path, layout, **kw):
    from cfp.runtime.training import DataSource, TrainOptions
    base = dict(model="llama2", layout=layout, overrides=RUN_OVERRIDES, steps=4, data=DataSource.STDLIB, learning_rate=LR, weight_decay=WD,
                checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1)
    base.update(kw)
    return TrainOptions(**base)


def test_resume_reproduces_losses_also_on_another_layout(tmp_path):
    import functools

    from cfp.runtime.training import run_training
    # the runs share one compile cache (each program compiles once); what a resumed run rebuilds is its state
    run_training = functools.partial(run_training, cache=programs(__import__("cfp.models", fromlist=["get_config"]).get_config("llama2", "tiny", **RUN_OVERRIDES)))
    quiet = lambda *a, **k: None
    lay = Layout.from_lists([[2, 1]], [[1, 1]], [4], [2])
    full = run_training(_opts(tmp_path / "a", lay, timeline_dir=str(tmp_path / "tl")), log=quiet)
    assert sorted(full.losses) == [1, 2, 3, 4]
    # "killed" after step 2 (checkpoints of steps 1 and 2 on disk), then resumed
    run_training(_opts(tmp_path / "b", lay, stop_after=2), log=quiet)
    said = []
    resumed = run_training(_opts(tmp_path / "b", lay, resume=True), log=lambda *a, **k: said.extend(a))
    assert [resumed.losses[k] for k in range(1, 5)] == [full.losses[k] for k in range(1, 5)]
    assert any("resumed from" in line and "step 2" in line and "resharded" not in line for line in said)
    # resume the step-2 checkpoint onto a different layout (two pipelines, batches 3 + 1): it says so
    other = Layout.from_lists([[1], [2]], [[2], [2]], [3, 1], [3, 1])
    run_training(_opts(tmp_path / "c", lay, stop_after=2), log=quiet)
    said.clear()
    moved = run_training(_opts(tmp_path / "c", other, resume=True, verify=True),
                         log=lambda *a, **k: said.extend(a))
    assert any("resharded from layout tp2x1L+tp1x1L (2x2) onto tp1x2L (3x1) | tp2x2L (1x1)" in line for line in said)
    np.testing.assert_allclose([moved.losses[k] for k in range(1, 5)],
                               [full.losses[k] for k in range(1, 5)], rtol=1e-5)
    # verify's reference builds AdamW from optax itself: with WD the decay is 1e-4 of the parameters per step,
    # 10x this bound, so a run whose optimizer lost it (or a reference that shared the engine's) would fail
    assert moved.verify_ok and moved.verify_error < 1e-5
    _check_timeline(tmp_path / "tl", full.bubbles[0])


def _check_timeline(tl_dir, summary):
    """timeline.json + .png; events respect the schedule's dependencies; the reported bubble is the
    one the events give (busy time and makespan recomputed here)."""
    data = json.loads((tl_dir / "timeline.json").read_text())
    ev = {(e["stage"], e["microbatch"], e["phase"]): (e["start"], e["end"]) for e in data["events"]}
    assert set(ev) == {(s, m, ph) for s in (0, 1) for m in (0, 1) for ph in ("fwd", "bwd")}
    for m in (0, 1):
        assert ev[(1, m, "fwd")][0] >= ev[(0, m, "fwd")][1]   # stage 1 needs stage 0's activation
        assert ev[(0, m, "bwd")][0] >= ev[(1, m, "bwd")][1]   # stage 0 needs stage 1's gradient
        for s in (0, 1):
            assert ev[(s, m, "bwd")][0] >= ev[(s, m, "fwd")][1]
    for s in (0, 1):  # one stage runs one action at a time
        spans = sorted(v for k, v in ev.items() if k[0] == s)
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
    busy = sum(end - start for start, end in ev.values())
    makespan = max(e for _, e in ev.values()) - min(s for s, _ in ev.values())
    assert summary["bubble"] == pytest.approx(1 - busy / (2 * makespan), abs=1e-6)
    assert summary["theoretical_bubble"] == pytest.approx(1 / 3)
    # measured events respecting their dependencies never idle less than their own times allow
    assert summary["valid"] and summary["bubble"] >= summary["minimum_bubble"] - 1e-6
    assert all(end > start for start, end in ev.values())      # no zero-length (inferred) events
    assert (tl_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

# ----------------------------------------------------------------------------- NaN / Inf


def test_nan_is_an_error_naming_step_and_leaf():
    import jax
    from cfp.errors import NumericalError
    cfg = tiny(2)  # the tp2-into-tp1 programs: no new compile
    trainer = make_trainer(cfg, Layout.from_lists([[2, 1]], [[1, 1]], [4], [2]))
    params, opt, _ = trainer.init().state()
    batch = batches("llama2", cfg, 4)[0]
    leaf = jax.tree_util.tree_flatten_with_path(params["layers"][1])[0][0][0]
    name = "['layers'][1]" + jax.tree_util.keystr(leaf)

    def poisoned(tree, where):
        def f(path, v):
            v = np.array(v)
            if jax.tree_util.keystr(path).endswith(name):
                v.flat[0] = np.nan
            return v
        return jax.tree_util.tree_map_with_path(f, tree) if where else tree
    # NaN in Adam's first moment: loss and gradient finite, the updated parameter is not
    bad_opt = (opt[0]._replace(mu=poisoned(opt[0].mu, True)),) + tuple(opt[1:])
    trainer.load_state(params, bad_opt, 0)
    with pytest.raises(NumericalError, match=r"^step 1: parameter after the update of "
                       + __import__("re").escape(name) + r" \(stage \(0, 1\)\) is NaN or Inf$"):
        trainer.step(batch)
    # NaN in a parameter: the loss of step 5 is NaN
    trainer.load_state(poisoned(params, True), opt, 4)
    with pytest.raises(NumericalError, match=r"^step 5: loss is nan$"):
        trainer.step(batch)


def test_verify_comparisons_refuse_nan_and_mismatched_trees():
    from cfp.errors import ConfigError, NumericalError
    from cfp.runtime.verify import loss_error, tree_error
    a = {"w": np.ones(3), "b": np.zeros(2)}
    assert tree_error(a, a) == 0.0 and loss_error([1.0], [1.0]) == 0.0
    with pytest.raises(NumericalError, match=r"loss 2 of 2 compared is nan"):
        loss_error([1.0, float("nan")], [1.0, 1.0])
    with pytest.raises(NumericalError, match=r"reference loss 1 of 1 compared is inf"):
        loss_error([1.0], [float("inf")])
    with pytest.raises(NumericalError, match=r"leaf \['w'\]: value contains NaN"):
        tree_error({"w": np.array([1.0, np.nan, 1.0]), "b": np.zeros(2)}, a)
    with pytest.raises(ConfigError, match="differ in structure"):
        tree_error({"w": np.ones(3)}, a)
    with pytest.raises(ConfigError, match=r"leaf \['w'\] has shape \(2,\)"):
        tree_error({"w": np.ones(2), "b": np.zeros(2)}, a)
