"""Searched stage plans: the runtime on searched per-stage shardings gives the single-device gradient, a
second search with the same layout profiles nothing, plans round-trip through their directory."""
import numpy as np
import pytest

from cfp.search.plan import spec_from_entries
from programs import trainer_of, zoo_batch, zoo_cache

from cfp.errors import ConfigError
from cfp.layout import Layout

# Two pipelines: TP-2 + TP-2 stages, and one TP-4 stage holding every layer and the head.
LISTS = ([[2, 2], [4]], [[1, 1], [2]], [4, 2], [2, 1])


def _cfg():
    from cfp.models import get_config
    return get_config("llama2", "tiny", num_layers=2, seq_len=8, vocab_size=64, hidden_size=32, ffn_size=64)


def _options(cache_dir):
    from cfp.runtime.stage.plans import StagePlanOptions
    from cfp.search.options import SearchOptions
    # the cost model ranks and the DP's best is taken unverified (no timing on a shared host, fewer compiles)
    return StagePlanOptions("search", search=SearchOptions().replace(
        kind="estimate", gpu="A100-SXM-80G", cache_dir=str(cache_dir), max_combinations=2, top_k=2, verify=0))


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    from cfp.runtime.stage.plan_search import search_stage_plans
    cache = tmp_path_factory.mktemp("profiles")
    layout = Layout.from_lists(*LISTS)
    programs = zoo_cache("llama2", _cfg())
    plans = search_stage_plans(layout, programs, _options(cache), zoo_batch("llama2", _cfg()), log=print)
    return layout, plans, cache, programs


def test_stage_plans_give_the_single_device_gradient(searched):
    import jax
    from cfp.models import make_batch
    from cfp.runtime.verify import zoo_reference
    layout, plans, _, programs = searched
    cfg = _cfg()
    trainer = trainer_of(programs, layout, plans=plans).init()
    replayed = sorted(k for k, pr in trainer.programs.items() if pr.replay is not None)
    assert replayed and replayed == sorted(p.key for p in plans.plans if p.runs_searched)
    for p in plans.plans:      # the runtime runs on the plans' layouts, not the Megatron rules
        if not p.runs_searched:
            continue
        prog = trainer.programs[p.key]
        specs = {k: spec_from_entries([list(x) if isinstance(x, tuple) else x for x in e])
                 for k, e in p.sharding.params}
        for path, sh in jax.tree_util.tree_flatten_with_path(prog.shardings)[0]:
            assert sh.spec == specs[jax.tree_util.keystr(path)]
    batch = jax.tree_util.tree_map(np.asarray, make_batch("llama2", cfg, layout.global_batch, 7))
    for key in replayed:       # a searched stage's backward recomputes nothing of its forward (none is the default)
        prog, st = trainer.programs[key], trainer.programs[key].stage
        mb = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((layout.pipelines[key[0]].micro_batch,)
                                                                   + a.shape[1:], a.dtype), batch)
        x = None if st.is_first else trainer._act_shape((key[0], key[1] - 1), mb)
        split = prog.kept_programs.split(x, mb if (st.is_first or st.is_last) else None)
        assert split.recomputed(split.whole) == () and split.recomputed(split.w) == (), key
    for schedule in ("gpipe", "1f1b", "zb-h1"):      # zb-h1: a searched stage's B and W
        trainer.set_schedule(schedule)
        grads, loss = trainer.gradients(batch)
        params = trainer.state()[0]
        ref_loss, ref = jax.value_and_grad(zoo_reference("llama2", cfg, 1e-3, 0.01)[0])(params, batch)
        assert np.isfinite(loss) and abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        # float32 reduction order differs (micro-batches, sharded contractions, summed pipelines): the
        # runtime's equivalence tests measure ~1e-7 relative; 1e-5 of the leaf's largest entry holds on any ISA
        for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
            r = np.asarray(r)
            assert np.all(np.isfinite(g))
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())
    _check_steps(trainer, cfg, layout)


def _check_steps(trainer, cfg, layout, steps: int = 2):
    """Losses and parameters after AdamW steps on the searched stages vs one device accumulating the same
    micro-batches in the same order, its optimizer built from optax directly (cfp.runtime.verify): a stage
    whose update is skipped or wrong fails. Tolerances as in test_runtime (measured float32 reordering noise
    <= 1e-6 normwise; the updates move the parameters by ~1e-2)."""
    import jax
    from cfp.models import make_batch
    from cfp.runtime.verify import loss_error, microbatched_replay, tree_error
    from references import identical_across_pipelines
    params0, opt0, _ = trainer.init().state()
    data = [jax.tree_util.tree_map(np.asarray, make_batch("llama2", cfg, layout.global_batch, 20 + i))
            for i in range(steps)]
    ref_losses, ref_params, _ = microbatched_replay("llama2", cfg, layout, params0, opt0, data,
                                                    learning_rate=1e-3, weight_decay=0.01)
    losses = [trainer.step(b).loss for b in data]
    assert loss_error(losses, ref_losses) < 1e-5
    assert tree_error(trainer.state()[0], ref_params) < 1e-5
    assert tree_error(params0, ref_params) > 100 * 1e-5     # the updates are far above the tolerance
    assert identical_across_pipelines(trainer)              # pipeline 1's stages updated alike (state() shows 0's)


def _sdy(spec, names) -> str:
    return "[" + ", ".join("{" + ", ".join(f'"{names[a]}"' for a in axes) + "}" for axes in spec) + "]"


def test_stage_programs_impose_the_searched_block_layouts(searched):
    """The bwd program of a searched stage constrains every forward dot's result to the layout its block's
    searched strategy gives it (GSPMD alone would be free to pick another); the Megatron stage has none."""
    import re
    layout, plans, _, programs = searched
    runs = {"plan": trainer_of(programs, layout, plans=plans), "megatron": trainer_of(programs, layout)}
    replays = {k: pr.replay for k, pr in runs["plan"].programs.items() if pr.replay is not None}
    key = next(k for k, r in replays.items() if not r.shardings.shard_state)
    found = {}
    for name, trainer in runs.items():
        prog, args = trainer.compile_jobs(key)[1]           # the stage's bwd and its abstract arguments
        text = prog.lower(*args).as_text()
        found[name] = set(re.findall(r"sdy.sharding_constraint %\S+ <@mesh, (\[[^\]]*\])> : (tensor<[^>]*>)", text))
    assert not found["megatron"]
    r = replays[key]
    g, names = r.analysis.graph, r.analysis.mesh.axis_names
    expected = set()
    for lay in r.shardings.layouts:
        t = g.operators[r.analysis.blocks[lay.block].forward.op].outputs[0]
        spec, tensor = lay.spec_of[t], g.tensor(t)
        if any(spec):
            dt = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[tensor.dtype]
            expected.add((_sdy(spec, names), "tensor<" + "x".join(map(str, tensor.shape)) + f"x{dt}>"))
    assert expected and expected <= found["plan"], expected - found["plan"]


def test_second_search_profiles_nothing(searched, capsys):
    from cfp.runtime.stage.plan_search import search_stage_plans
    layout, first, cache, _ = searched
    searched_first = [p for p in first.plans if p.figures]
    assert searched_first and all(p.figures.profile_compiles > 0 for p in searched_first[:1])
    # a fresh compile cache (another run): only the profile cache on disk is shared
    again = search_stage_plans(layout, zoo_cache("llama2", _cfg()), _options(cache), zoo_batch("llama2", _cfg()),
                               log=print)
    assert [p.figures.profile_compiles for p in again.plans if p.figures] == [0] * len(searched_first)
    assert "nothing compiled, all from the profile cache" in capsys.readouterr().out
    assert [p.sharding for p in again.plans] == [p.sharding for p in first.plans]


def test_plans_round_trip_and_refuse_another_layout(searched, tmp_path):
    import dataclasses

    import jax
    from cfp.runtime.stage.builder import build_programs
    from cfp.runtime.stage.plans import StagePlans
    layout, plans, _, programs = searched
    plans.save(str(tmp_path))
    back = StagePlans.load(str(tmp_path)).check(layout, "llama2")
    assert back == plans
    won = [dataclasses.replace(p, megatron=True) if p.key == (1, 0) else p for p in plans.plans]
    example = zoo_batch("llama2", _cfg())
    built = build_programs(layout, jax.devices(), programs, StagePlans(plans.model, plans.layout, tuple(won)),
                           example)
    # a stage Megatron won runs the Megatron sharding
    assert built[(1, 0)].replay is None and built[(0, 0)].replay is not None
    p00 = next(p for p in plans.plans if p.key == (0, 0))
    s = p00.sharding
    edited = dataclasses.replace(p00, sharding=dataclasses.replace(s, choice=(s.choice[0] + 1,) + s.choice[1:]))
    with pytest.raises(ConfigError, match=r"stage plan of stage \(0, 0\) does not fit the analysed stage step"):
        build_programs(layout, jax.devices(), programs,
                       StagePlans(plans.model, plans.layout, (edited,) + plans.plans[1:]), example)
    other = Layout.from_lists([[2, 2], [4]], [[1, 1], [2]], [8, 2], [2, 1])   # another micro-batch
    with pytest.raises(ConfigError, match=r"no plan for stage \(0, 0\)"):
        back.check(other, "llama2")
    with pytest.raises(ConfigError, match="made for model 'llama2'"):
        back.check(layout, "gpt")


def test_resumed_run_keeps_its_stage_plans(searched, tmp_path):
    from cfp.runtime.stage.plan_sources import PlanRequest, plans_for_run
    from cfp.runtime.stage.plans import StagePlanOptions
    layout, plans, cache, programs = searched
    plans.save(str(tmp_path / "ck" / "stage_plans"))
    logs = []
    example = zoo_batch("llama2", _cfg())
    got = plans_for_run(PlanRequest(options=_options(cache), layout=layout, cache=programs, batch_like=example,
                                    checkpoint_dir=str(tmp_path / "ck"), resume=True, log=logs.append))
    assert got == plans and any("reused" in line for line in logs)
    saved = StagePlanOptions.parse(str(tmp_path / "ck" / "stage_plans"))
    got = plans_for_run(PlanRequest(options=saved, layout=layout, cache=programs, batch_like=example,
                                    log=logs.append))
    assert got == plans and "loaded" in logs[-1]


def test_cli_bad_stage_plans_is_one_line_exit_2(capsys, tmp_path):
    from cfp.cli.main import main
    code = main(["train", "--model", "llama2", "--hetero-configs", "[[2,2]]", "--stage-plans",
                 str(tmp_path / "nowhere"), "--data", "synthetic"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "neither megatron, search nor a directory" in err


def test_search_times_megatron_side_by_side(tmp_path):
    """With whole-step verification the stage's winner is compared with its Megatron sharding on the same
    step and cost model, and the faster one is what the plan runs."""
    from cfp.models import get_config
    from cfp.runtime.stage.builder import build_programs
    from cfp.runtime.stage.plans import StagePlanOptions
    from cfp.search.options import SearchOptions
    from cfp.runtime.stage.plan_search import search_stage_plans
    import jax
    layout = Layout.from_lists([[2]], [[1]], [2], [1])
    cfg = get_config("llama2", "tiny", num_layers=1, seq_len=8, vocab_size=64, hidden_size=32, ffn_size=64)
    opts = StagePlanOptions("search", search=SearchOptions().replace(
        kind="estimate", gpu="A100-SXM-80G", cache_dir=str(tmp_path), max_combinations=2, top_k=1, verify=1))
    logs = []
    programs = zoo_cache("llama2", cfg)
    plans = search_stage_plans(layout, programs, opts, zoo_batch("llama2", cfg), log=logs.append)
    (plan,) = plans.plans
    s, m = plan.figures.searched, plan.figures.megatron
    assert m.time > 0 and m.memory > 0 and s.time > 0   # estimated: compiled
    assert plan.megatron == (m.time + m.boundary_time < s.time + s.boundary_time)
    assert "side by side (estimated)" in logs[-1]
    built = build_programs(layout, jax.devices(), programs, plans, zoo_batch("llama2", cfg))
    assert (built[plan.key].replay is not None) == (not plan.megatron)


def test_same_stage_sharding_compares_placements_not_spelling():
    """A searched stage plan whose parameters, optimizer state and activations are placed as Megatron's is
    named the Megatron sharding (no side-by-side ratio of a sharding with itself)."""
    from types import SimpleNamespace

    from jax.sharding import NamedSharding, PartitionSpec as P

    from cfp.mesh import MeshSpec
    from cfp.runtime.stage.compare import _same_stage_sharding
    mesh = MeshSpec.parse("4").make()
    ax = mesh.axis_names[0]

    case = SimpleNamespace(x_like={"h": __import__("jax").ShapeDtypeStruct((4, 8, 16), np.float32)},
                           y_like={"h": __import__("jax").ShapeDtypeStruct((4, 8, 16), np.float32)})

    def stage(w, act):
        s = lambda spec: NamedSharding(mesh, spec)
        return SimpleNamespace(shardings={"w": s(w)}, opt_shardings=({"w": s(w)},),
                               act_in_shardings=lambda like: {"h": s(act)}, act_out_shardings=lambda like: [s(act)])
    megatron = stage(P(None, ax), P())
    assert _same_stage_sharding(stage(P(None, ax), P(None, None, None)), megatron, case)
    assert not _same_stage_sharding(stage(P(ax, None), P()), megatron, case)
    assert not _same_stage_sharding(stage(P(None, ax), P(ax)), megatron, case)


def test_search_then_training_builds_each_stage_program_once(tmp_path, monkeypatch):
    """The stage-plan search leaves the programs it built (and timed) in the engine's compile cache: training
    after it builds no stage program, replay or analysed step again, and runs the very programs the search
    built. Two pipelines of equal TP-2 stages: the second reuses the first's plan, replay and analysis, and
    gets its own program (its own devices)."""
    import jax
    from cfp.models import make_batch
    from cfp.runtime.stage import cases
    from cfp.runtime.stage.plans import StagePlanOptions
    from cfp.search.options import SearchOptions
    from cfp.runtime.stage.program import StageProgram
    from cfp.runtime.stage.replay import StageReplay
    from cfp.runtime.stage.plan_search import search_stage_plans
    built = {"program": [], "replay": 0, "analysis": 0}
    init_program, init_replay, analyse = StageProgram.__init__, StageReplay.__init__, cases.analyze_with_program

    def program(self, *a, **kw):
        init_program(self, *a, **kw)
        built["program"].append(self)

    def replay(self, *a, **kw):
        init_replay(self, *a, **kw)
        built["replay"] += 1

    def analysis(*a, **kw):
        built["analysis"] += 1
        return analyse(*a, **kw)
    monkeypatch.setattr(StageProgram, "__init__", program)
    monkeypatch.setattr(StageReplay, "__init__", replay)
    monkeypatch.setattr(cases, "analyze_with_program", analysis)
    layout = Layout.from_lists([[2], [2]], [[1], [1]], [2, 2], [1, 1])
    cfg = _one_layer_cfg()
    opts = StagePlanOptions("search", search=SearchOptions().replace(
        kind="estimate", gpu="A100-SXM-80G", cache_dir=str(tmp_path), max_combinations=2, top_k=1, verify=1))   # verify: the searched program is built
    programs = zoo_cache("llama2", cfg)
    plans = search_stage_plans(layout, programs, opts, zoo_batch("llama2", cfg), log=lambda *_: None)
    in_search = list(built["program"])
    assert built["analysis"] == 1 and built["replay"] == 1     # one signature: analysed and cut once
    # each stage: its Megatron program; the searched stage: also its plan's program (timed against Megatron)
    assert len(in_search) == 3 and sum(p.replay is not None for p in in_search) == 1
    trainer = trainer_of(programs, layout, plans=plans).init()
    stats = trainer.step(jax.tree_util.tree_map(np.asarray, make_batch("llama2", cfg, 4, 3)))
    assert np.isfinite(stats.loss)
    new = [p for p in built["program"] if not any(p is q for q in in_search)]
    assert built["analysis"] == 1 and built["replay"] == 1
    runs = trainer.programs
    # stage (0, 0) runs the program the search built; (1, 0) needed one of its own devices, built once
    assert any(runs[(0, 0)] is p for p in in_search)
    assert [p.stage.key for p in new] == ([(1, 0)] if plans.plans[1].runs_searched else [])
    assert len(built["program"]) == len({(p.stage.key, p.replay is not None) for p in built["program"]})


def _one_layer_cfg():
    from cfp.models import get_config
    return get_config("llama2", "tiny", num_layers=1, seq_len=8, vocab_size=64, hidden_size=32, ffn_size=64)
