"""Issue 42, item 1: the layouts users write (data parallel, FSDP by input/output shardings alone, DP x TP by the
Megatron rules) and the Alpa-style ILP's plan are whole-step candidates of every search; the plan returned under
a budget is the fastest candidate that fits it; a layout plan saves and applies like a searched one."""
import jax
import numpy as np
import optax
import pytest

from cfp.analysis.analysis import analyze_with_program
from cfp.api import apply_plan, autoshard, load_plan
from cfp.baselines.user_layouts import Layout, user_layout_shardings
from cfp.errors import ConfigError
from cfp.search.options import SearchOptions
from cfp.search.search import StepCache, _budget_of_data_parallel, host_copies
from cfp.search.plan import make_plan
from cfp.sharding.step import ShardedStep
from cfp.xla.compiled import compiled_memory


def _adam_problem():
    """A plain-JAX MLP trained by optax SGD with momentum, `(params, opt_state, x, y) -> (loss, params,
    opt_state)` (not Adam: its normalised update of a near-zero gradient amplifies rounding differences)."""
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k[0], (32, 128)) * 0.1, "w2": jax.random.normal(k[1], (128, 32)) * 0.1}
    opt = optax.sgd(1e-2, momentum=0.9)

    def step(p, s, x, y):
        def loss_fn(p):
            return ((jax.numpy.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = opt.update(g, s, p)
        return loss, optax.apply_updates(p, u), s
    return step, (params, opt.init(params), jax.random.normal(k[2], (16, 32)), jax.random.normal(k[3], (16, 32)))


@pytest.fixture(scope="module")
def problem():
    step, args = _adam_problem()
    analysis, program = analyze_with_program(step, "2x4", *args)
    return step, args, analysis, program


def test_plain_fsdp_shards_state_on_its_largest_dim_and_splits_the_batch(problem):
    step, args, analysis, program = problem
    sh = user_layout_shardings(Layout.FSDP, analysis, args)
    specs = dict(zip(analysis.graph.input_paths, sh.input_specs))
    every = tuple(analysis.mesh.axis_names)
    assert specs["[0]['w1']"] == jax.sharding.PartitionSpec(None, every)      # [32, 128]: dim 1
    assert specs["[0]['w2']"] == jax.sharding.PartitionSpec(every)            # [128, 32]: dim 0
    assert specs["[1][0].trace['w1']"] == specs["[0]['w1']"]                  # the momentum like its weight
    assert specs["[2]"] == specs["[3]"] == jax.sharding.PartitionSpec(every)  # the batch split
    assert not sh.constrained
    dp = dict(zip(analysis.graph.input_paths, user_layout_shardings(Layout.DATA_PARALLEL, analysis, args).input_specs))
    assert dp["[0]['w1']"] == jax.sharding.PartitionSpec() and dp["[2]"] == specs["[2]"]
    sharded = ShardedStep(program, analysis, sh, analysis.mesh.make())
    want = jax.jit(step)(*args)
    for got, ref in zip(jax.tree_util.tree_leaves(sharded(*args)), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
    # state sharded 8 ways: less per-device memory than data parallel's replicated state
    dp_step = ShardedStep(program, analysis, user_layout_shardings(Layout.DATA_PARALLEL, analysis, args),
                          analysis.mesh.make())
    assert compiled_memory(sharded.compile(*args)) < compiled_memory(dp_step.compile(*args))


def test_a_layout_plan_saves_and_applies(problem, tmp_path):
    step, args, analysis, program = problem
    plan = make_plan(analysis, user_layout_shardings(Layout.FSDP, analysis, args), layout=Layout.FSDP)
    path = plan.save(str(tmp_path / "fsdp.json"))
    loaded = load_plan(path)
    assert loaded.layout == "fsdp" and loaded == plan
    again = apply_plan(step, "2x4", *args, plan=path)
    assert again.shardings.input_specs == user_layout_shardings(Layout.FSDP, analysis, args).input_specs
    assert not again.shardings.constrained
    np.testing.assert_allclose(float(again(*args)[0]), float(jax.jit(step)(*args)[0]), rtol=1e-6)


@pytest.fixture(scope="module")
def budgeted(problem, tmp_path_factory):
    """autoshard under a budget between plain FSDP's compiled memory and data parallel's (estimated times:
    the same figures on every host)."""
    step, args, analysis, program = problem
    mesh = analysis.mesh.make()
    mem = {l: compiled_memory(ShardedStep(program, analysis, user_layout_shardings(l, analysis, args), mesh)
                              .compile(*args)) for l in (Layout.FSDP, Layout.DATA_PARALLEL)}
    budget = (mem[Layout.FSDP] + mem[Layout.DATA_PARALLEL]) // 2
    out = str(tmp_path_factory.mktemp("plan") / "plan.json")
    return autoshard(step, "2x4", *args, memory_limit=budget, profiler="estimate", gpu="A100-SXM-80G",
                     max_combinations=4, plan_out=out), budget, out


def test_every_user_layout_and_the_ilp_is_a_candidate(budgeted):
    res = budgeted[0].search
    labels = {v.label for v in res.layouts}
    assert {"plain data parallel", "plain FSDP", "DP x TP (Megatron)", "Alpa-style ILP"} <= labels
    assert all(v.layout for v in res.layouts) and not any(v.layout for v in res.verified)
    assert "whole-step candidates" in res.candidates_text() and "plain FSDP" in res.candidates_text()


def test_the_plan_under_a_budget_is_the_fastest_candidate_that_fits(budgeted, problem):
    step, res, budget, out = budgeted[0], budgeted[0].search, budgeted[1], budgeted[2]
    fitting = [v for v in res.verified + res.layouts if v.memory <= budget]
    assert res.best.memory <= budget
    assert res.best.time == min(v.time for v in fitting)
    _, args, _, _ = problem
    assert compiled_memory(step.compile(*args)) <= budget
    # some candidate is over the budget and estimated faster than the chosen one: the budget decided
    over = [v for v in res.verified + res.layouts if v.memory > budget]
    assert over
    text = res.margin_text()
    assert f"chosen plan ({res.best.label}" in text and "runner-up (" in text
    if res.best.layout in ("data-parallel", "fsdp", "dp-tp"):
        assert "a layout users write" in text
    if res.best.layout:
        assert load_plan(out).layout == res.best.layout
    again = apply_plan(problem[0], "2x4", *args, plan=out)
    np.testing.assert_allclose(float(again(*args)[0]), float(jax.jit(problem[0])(*args)[0]), rtol=1e-5)


def test_budget_fraction_is_of_plain_data_parallel_compiled_once(problem):
    """SearchOptions.budget_fraction: the budget is that fraction of plain data parallel's compiled memory, and
    the step compiled to work it out is the search's plain data parallel candidate (its `StepCache` entry), not
    cfp's constrained data parallel nor a second copy."""
    step, args, analysis, program = problem
    dp = compiled_memory(ShardedStep(program, analysis, user_layout_shardings(Layout.DATA_PARALLEL, analysis, args),
                                     analysis.mesh.make()).compile(*args))
    steps = StepCache(program, analysis, analysis.mesh.make())
    opts = _budget_of_data_parallel(analysis, args, SearchOptions(budget_fraction=0.9), steps=steps, log=print)
    assert opts.memory_per_device == int(dp * 0.9) and opts.budget_fraction is None
    assert list(steps) == [(user_layout_shardings(Layout.DATA_PARALLEL, analysis, args).choice, (),
                            Layout.DATA_PARALLEL.value)]
    res = autoshard(step, "2x4", *args, options=SearchOptions(budget_fraction=0.9), profiler="estimate",
                    gpu="A100-SXM-80G", max_combinations=2).search
    assert res.budget == int(dp * 0.9)
    plain = [v for v in res.layouts if v.layout == Layout.DATA_PARALLEL.value]
    assert len(plain) == 1 and plain[0].memory == dp and plain[0].time == float("inf")     # over 90% of itself
    assert res.best.memory <= res.budget


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), True, "0.85"])
def test_budget_fraction_must_be_a_positive_number(bad):
    with pytest.raises(ConfigError):
        SearchOptions(budget_fraction=bad)


def test_budget_fraction_and_a_budget_are_exclusive():
    with pytest.raises(ConfigError, match="not both"):
        SearchOptions(budget_fraction=0.85, memory_per_device="1MB")


def test_host_copies_are_numpy_with_the_same_values():
    x = jax.numpy.arange(6.0).reshape(2, 3)
    key = jax.random.key(0)
    out = host_copies({"x": x, "key": key, "n": 3})
    assert isinstance(out["x"], np.ndarray) and not isinstance(out["x"], jax.Array)
    np.testing.assert_array_equal(out["x"], np.asarray(x))
    assert out["key"] is key and out["n"] == 3
