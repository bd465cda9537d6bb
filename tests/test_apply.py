"""Applying strategy choices: the sharded program gives the unsharded numbers, and XLA's collectives are
the ones the analysis predicts (a block called communication-free compiles without any collective)."""
import random

import jax
import numpy as np
import pytest

from cfp.analysis.analysis import analyze_with_program
from cfp.sharding.step import apply_choice
from cfp.sharding.check import check_collectives
from cfp.errors import ConfigError
from cfp.models import get_config, loss_fn, make_batch, train_step
from conftest import assert_adam_step_matches, assert_same_tree


def _grad_problem(model, mesh):
    cfg = get_config(model, "tiny", num_layers=1)
    ts = train_step(model, cfg)
    params, _ = ts.init(jax.random.PRNGKey(0))
    batch = make_batch(model, cfg, 8, jax.random.PRNGKey(1))
    step = jax.value_and_grad(loss_fn(model, cfg))
    analysis, program = analyze_with_program(step, mesh, params, batch)
    return step, (params, batch), analysis, program


def _choices(analysis, kinds, seed):
    rng = random.Random(seed)
    for kind in kinds:
        if kind == "first":
            yield [0] * len(analysis.blocks)
        elif kind == "last":
            yield [len(b.strategies) - 1 for b in analysis.blocks]
        else:
            yield [rng.randrange(len(b.strategies)) for b in analysis.blocks]


def _assert_close(got, want):
    assert_same_tree(got, want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5 * max(1.0, float(np.abs(b).max())))


# each compile of a sharded step takes ~10 s on 2 cores: several assignments per model, not all of them
@pytest.mark.parametrize("model,mesh,kinds", [("gpt", "2x4", ("first", "last", "random")), ("gpt", "8", ("random",)),
                                              ("llama2", "2x4", ("first", "random")), ("moe", "8", ("last", "random"))])
def test_sharded_loss_and_grads_match_unsharded_and_collectives_match_prediction(model, mesh, kinds):
    step, args, analysis, program = _grad_problem(model, mesh)
    want = jax.jit(step)(*args)
    for choice in _choices(analysis, kinds, seed=len(model)):
        sharded = apply_choice(program, analysis, choice)
        got = sharded(*args)
        _assert_close(got, want)
        found = sharded.collectives(*args)
        assert check_collectives(analysis, sharded.shardings, found) == [], choice
        for lay in sharded.shardings.layouts:
            if not lay.collectives:
                assert not [c for c in found if c.block == lay.block and not c.reshard], \
                    f"block {lay.block} predicted communication-free but compiled with collectives"


def _train_problem(mesh):
    """A 1-layer tiny GPT's AdamW step: (train step, params, opt state, batch, analysis, program)."""
    ts = train_step("gpt", get_config("gpt", "tiny", num_layers=1))
    params, opt = ts.init(jax.random.PRNGKey(0))
    batch = ts.make_batch(8, jax.random.PRNGKey(1))
    analysis, program = analyze_with_program(ts.step, mesh, params, opt, batch)
    return ts, params, opt, batch, analysis, program


def test_full_train_step_matches_single_device():
    ts, params, opt, batch, analysis, program = _train_problem("8")
    dp = [next(i for i, s in enumerate(b.strategies) if analysis.notation(b.index, i).split(" = ")[0].startswith("S"))
          for b in analysis.blocks]
    sharded = apply_choice(program, analysis, dp)
    want = jax.jit(ts.step)(params, opt, batch)
    got = sharded(params, opt, batch)
    assert_adam_step_matches(params, got, want)
    # the parameters come back sharded as the plan says (ready for the next step without resharding)
    leaves = jax.tree_util.tree_leaves(got[0])
    assert all(len(x.sharding.device_set) == 8 for x in leaves)


def test_bad_choice_is_rejected_with_the_value():
    _, args, analysis, program = _grad_problem("gpt", "8")
    with pytest.raises(ConfigError, match="choice has 2 strategies"):
        apply_choice(program, analysis, [0, 0])
    bad = [0] * len(analysis.blocks)
    bad[3] = 99
    with pytest.raises(ConfigError, match="strategy 99 of block 3"):
        apply_choice(program, analysis, bad)


def test_sharded_state_matches_single_device_and_shrinks_memory():
    # ZeRO-3 on top of the block strategies: on a 2x4 mesh under data parallel over both axes, every
    # parameter and optimizer-state leaf is stored cut 8 ways where a dim divides, and the step still
    # computes the single-device numbers
    from cfp.analysis.blocks import data_parallel_choice
    ts, params, opt, batch, analysis, program = _train_problem("2x4")
    dp = data_parallel_choice(analysis.graph, analysis.blocks)
    plain = apply_choice(program, analysis, dp)
    zero = apply_choice(program, analysis, dp, shard_state=True)
    assert zero.shardings.shard_state == tuple(range(len(analysis.blocks)))
    kernel = analysis.graph.input_paths.index("[0]['params']['layers_0']['mlp']['fc_in']['kernel']")
    # fc_in kernel [64, 256]: its largest dim takes both axes
    assert zero.shardings.input_specs[kernel] == jax.sharding.PartitionSpec(None, ("x0", "x1"))
    assert plain.shardings.input_specs[kernel] == jax.sharding.PartitionSpec()
    from cfp.xla.compiled import compiled_memory
    assert compiled_memory(zero.compile(params, opt, batch)) < 0.85 * compiled_memory(plain.compile(params, opt, batch))
    want = jax.jit(ts.step)(params, opt, batch)
    got = zero(params, opt, batch)
    assert_adam_step_matches(params, got, want)
    for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-3)
    fc_in = jax.tree_util.tree_leaves(got[0])[kernel]
    assert fc_in.sharding.spec == zero.shardings.input_specs[kernel]     # comes back stored sharded
    with pytest.raises(ConfigError, match="out of range"):
        apply_choice(program, analysis, dp, shard_state=[999])


def test_adam_step_check_fails_when_the_update_is_skipped(gpt_train_problem):
    """The parameter check above is not vacuous: a step that returns the old parameters fails it, and so does
    one whose update has the wrong sign in a single element well above noise."""
    ts, params, opt, batch = gpt_train_problem
    want = jax.jit(ts.step)(params, opt, batch)
    assert_adam_step_matches(params, want, want)
    with pytest.raises(AssertionError, match="update differs"):
        assert_adam_step_matches(params, (params, want[1], want[2]), want)
    leaves, tree = jax.tree_util.tree_flatten(want[0])
    i = max(range(len(leaves)), key=lambda j: leaves[j].size)
    flipped = np.asarray(leaves[i]).copy()
    p0 = np.asarray(jax.tree_util.tree_leaves(params)[i])
    m = np.abs(np.asarray(jax.tree_util.tree_leaves(want[1][0].mu)[i]))
    k = np.unravel_index(np.argmax(m), m.shape)
    flipped[k] = 2 * p0[k] - flipped[k]
    bad = jax.tree_util.tree_unflatten(tree, leaves[:i] + [flipped] + leaves[i + 1:])
    with pytest.raises(AssertionError, match="update differs"):
        assert_adam_step_matches(params, (bad, want[1], want[2]), want)
