"""Rematerialisation (`jax.checkpoint`, Flax `nn.remat`/`nnx.remat`, with policies) and opaque control flow.

A remat model analyses to its plain twin's blocks and segments (backward and recomputed dots pair with their
forward dot), its replay keeps remat's memory saving, the profiler's candidate ranking stays bounded on any
segment length, and a plan applied to a remat or cond/while step computes what the unsharded step computes.
"""
import json
import tracemalloc

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cfp
from cfp.analysis.analysis import analyze_with_program
from cfp.analysis.blocks import DotRole, data_parallel_choice
from cfp.ir.capture import capture
from cfp.ir.graph import OpGraph
from cfp.profiling.options import ProfileOptions
from cfp.profiling.profiler import beam_width, candidate_choices, ranked_combinations
from cfp.sharding.step import apply_choice
from programs import MlpStack, lm_step_problem, train

POLICIES = jax.checkpoint_policies
VOCAB, DIM, SEQ, HEADS, LAYERS, BATCH = 32, 32, 8, 2, 2, 8


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(use_bias=False)(x)
        x = x + nn.MultiHeadDotProductAttention(HEADS, deterministic=True, use_bias=False)(
            h, mask=nn.make_causal_mask(x[..., 0]))
        h = nn.Dense(2 * DIM, use_bias=False)(nn.LayerNorm(use_bias=False)(x))
        return x + nn.Dense(DIM, use_bias=False)(nn.gelu(h))


class _Transformer(nn.Module):
    remat: bool = False
    policy: object = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM)(tokens)
        block = nn.remat(_Block, policy=self.policy) if self.remat else _Block
        for i in range(LAYERS):
            x = block(name=f"layers_{i}")(x)
        return nn.Dense(VOCAB, use_bias=False)(x)


def _linen_problem(remat=False, policy=None):
    """A 2-layer Linen transformer's SGD step `(params, opt_state, x, y) -> (loss, params, opt_state)`."""
    return lm_step_problem(_Transformer(remat, policy), optax.sgd(0.1), BATCH, SEQ, VOCAB)


def _structure(analysis):
    """Per block its scope and the loop maps of its forward and backward dots; the segments."""
    blocks = tuple((b.scope, tuple(d.loop_map for d in b.dots if d.role is not DotRole.RECOMPUTE))
                   for b in analysis.blocks)
    return blocks, tuple((s.start, s.stop, s.kind) for s in analysis.segments)


def _recomputed(analysis):
    """Recomputed dots (each must follow its forward dot's strategy: the identity loop map)."""
    dots = [d for b in analysis.blocks for d in b.dots if d.role is DotRole.RECOMPUTE]
    assert all(d.loop_map == tuple(range(len(d.loop_map))) for d in dots)
    return len(dots)


@pytest.fixture(scope="module")
def plain_linen():
    step, args = _linen_problem()
    return cfp.analyze(step, "2x4", *args)


@pytest.mark.parametrize("policy,recomputes", [(None, True), (POLICIES.nothing_saveable, True),
                                               (POLICIES.dots_saveable, False),
                                               (POLICIES.dots_with_no_batch_dims_saveable, True)])
def test_linen_remat_analyses_like_its_plain_twin(plain_linen, policy, recomputes):
    step, args = _linen_problem(remat=True, policy=policy)
    analysis = cfp.analyze(step, "2x4", *args)
    assert _structure(analysis) == _structure(plain_linen)
    layer_kinds = {s.kind for s in analysis.segments if s.stop - s.start > 1}
    assert len([s for s in analysis.segments if s.stop - s.start > 1]) == LAYERS and len(layer_kinds) == 1
    assert (_recomputed(analysis) > 0) == recomputes


def _mlp_problem(wrap, layers=3, d=32, b=16):
    """The gradient step of `_mlp_loss`."""
    loss, args = _mlp_loss(wrap, layers, d, b)
    return jax.value_and_grad(loss), args


def _mlp_loss(wrap, layers=3, d=32, b=16):
    """A residual pure-JAX layer stack (no module scopes: segments come from repeated fingerprints), each
    layer wrapped by `wrap`; two dots on one source line test the tie-break between forward dots."""
    def layer(p, x):
        h = jax.nn.gelu(x @ p["w1"])
        a = jax.nn.softmax(h @ h.T / 8.0) @ h
        return x + a @ p["w2"]
    f = wrap(layer)

    def loss(ps, x):
        for p in ps:
            x = f(p, x)
        return jnp.mean(x ** 2)
    k = jax.random.split(jax.random.PRNGKey(0), 2 * layers + 1)
    ps = [{"w1": jax.random.normal(k[2 * i], (d, 2 * d)) * 0.1, "w2": jax.random.normal(k[2 * i + 1], (2 * d, d)) * 0.1}
          for i in range(layers)]
    return loss, (ps, jax.random.normal(k[-1], (b, d)))


@pytest.mark.parametrize("wrap,recomputes", [
    (jax.checkpoint, True),
    (lambda f: jax.checkpoint(f, prevent_cse=False), True),
    (lambda f: jax.checkpoint(jax.checkpoint(f)), True),
    (lambda f: jax.checkpoint(f, policy=POLICIES.dots_saveable), False),
    (lambda f: jax.checkpoint(f, policy=POLICIES.everything_saveable), False),
], ids=["default", "no_prevent_cse", "nested", "dots_saveable", "everything_saveable"])
def test_jax_checkpoint_per_layer_analyses_like_its_plain_twin(wrap, recomputes):
    plain = cfp.analyze(*_flat(_mlp_problem(lambda f: f)))
    analysis = cfp.analyze(*_flat(_mlp_problem(wrap)))
    assert _structure(analysis) == _structure(plain)
    assert (_recomputed(analysis) > 0) == recomputes
    assert OpGraph.from_dict(json.loads(analysis.graph.to_json())) == analysis.graph   # `recomputed` kept


def test_jax_checkpoint_over_the_whole_loss_analyses_like_its_plain_twin():
    loss, args = _mlp_loss(lambda f: f)
    whole = jax.value_and_grad(jax.checkpoint(loss))
    plain = cfp.analyze(jax.value_and_grad(loss), "2x4", *args)
    analysis = cfp.analyze(whole, "2x4", *args)
    assert _structure(analysis) == _structure(plain) and _recomputed(analysis) > 0


def _scanned_mlp_problem(wrap, layers=3, d=32, b=16):
    """`_mlp_loss`'s layer over stacked weights applied by `lax.scan`, the scan body wrapped by `wrap`."""
    def layer(x, p):
        h = jax.nn.gelu(x @ p["w1"])
        a = jax.nn.softmax(h @ h.T / 8.0) @ h
        return x + a @ p["w2"], None

    def loss(ps, x):
        return jnp.mean(jax.lax.scan(wrap(layer), x, ps)[0] ** 2)
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    ps = {"w1": jax.random.normal(k[0], (layers, d, 2 * d)) * 0.1,
          "w2": jax.random.normal(k[1], (layers, 2 * d, d)) * 0.1}
    return jax.value_and_grad(loss), (ps, jax.random.normal(k[2], (b, d)))


def _scanned_linen_problem(remat):
    return lm_step_problem(MlpStack(VOCAB, DIM, 3, scanned=True, remat=remat), optax.sgd(0.1), BATCH, SEQ, VOCAB)


@pytest.mark.parametrize("make,remat", [
    (_scanned_linen_problem, True),
    (_scanned_mlp_problem, jax.checkpoint),
    (_scanned_mlp_problem, lambda f: jax.checkpoint(f, policy=POLICIES.nothing_saveable)),
], ids=["nn.scan(nn.remat)", "lax.scan(jax.checkpoint)", "lax.scan(checkpoint nothing_saveable)"])
def test_remat_inside_a_scan_analyses_like_its_plain_scanned_twin(make, remat):
    """The body's recomputed dots join their forward dot's block, as in the unrolled remat model: unpaired, each
    would be a block of its own and the body segment longer than the plain twin's."""
    plain = cfp.analyze(*_flat(make(False if remat is True else (lambda f: f))))
    analysis = cfp.analyze(*_flat(make(remat)))
    assert _structure(analysis) == _structure(plain) and _recomputed(analysis) > 0
    assert [s.repeat for s in analysis.segments] == [s.repeat for s in plain.segments] and analysis.segments[0].repeat == 3
    body = analysis.segments[0].blocks
    assert all(analysis.graph.operators[d.op].loop is not None
               for b in body for d in analysis.blocks[b].dots if d.role is DotRole.RECOMPUTE)


def _flat(problem, mesh="2x4"):
    step, args = problem
    return (step, mesh, *args)


def test_nnx_remat_analyses_like_its_plain_twin():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(DIM, 2 * DIM, rngs=rngs), nnx.Linear(2 * DIM, DIM, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(x)))

    def analyse(remat):
        blocks = [Block(nnx.Rngs(i)) for i in range(3)]
        graphdef, state = nnx.split(nnx.List(blocks))

        def step(state, x):
            def loss(state):
                h = x
                for blk in nnx.merge(graphdef, state):
                    h = nnx.remat(lambda m, v: m(v))(blk, h) if remat else blk(h)
                return jnp.mean(h ** 2)
            return jax.value_and_grad(loss)(state)
        return cfp.analyze(step, "2x4", state, jnp.ones((16, DIM)))
    plain, remat = analyse(False), analyse(True)
    assert _structure(remat) == _structure(plain) and _recomputed(remat) > 0


def _temp_bytes(fn, args) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def test_replay_keeps_the_memory_saving_of_remat():
    """Inlined without its optimization barrier, XLA merges the recomputation back into the forward pass
    (measured 1.57 MB of temporaries replayed vs 0.79 MB as written); the replay must match the step."""
    def problem(remat):
        def layer(w, x):
            return jnp.tanh(jnp.tanh(x @ w) @ w.T)
        f = jax.checkpoint(layer) if remat else layer

        def loss(ws, x):
            for w in ws:
                x = f(w, x)
            return jnp.sum(x ** 2)
        ws = [jax.random.normal(jax.random.PRNGKey(i), (256, 256)) * 0.05 for i in range(4)]
        return jax.grad(loss), (ws, jax.random.normal(jax.random.PRNGKey(9), (256, 256)))
    temps = {}
    for remat in (False, True):
        step, args = problem(remat)
        temps[remat] = (_temp_bytes(step, args), _temp_bytes(capture(step, *args).as_function(), args))
    assert temps[True][0] < 0.75 * temps[False][0], temps      # remat saves memory as written...
    assert temps[True][1] <= temps[True][0], temps             # ...and as replayed by cfp
    assert temps[False][1] == temps[False][0], temps


def test_ranked_combinations_is_exact_within_its_limit():
    rng = np.random.default_rng(0)
    short = [[0, 2], [1, 3, 4], [0, 1], [2, 5]]
    unary = {(k, s): rng.random() for k, c in enumerate(short) for s in c}
    pairs = {(0, 2): {(a, b): rng.random() for a in short[0] for b in short[2]},
             (1, 3): {(a, b): rng.random() for a in short[1] for b in short[3]}}

    def score(c):
        return sum(unary[(k, s)] for k, s in enumerate(c)) + sum(t[(c[i], c[j])] for (i, j), t in pairs.items())
    fns = {k: (lambda a, b, t=t: (t[(a, b)],)) for k, t in pairs.items()}
    got = ranked_combinations(short, lambda k, s: (unary[(k, s)],), fns, width=24)
    want = sorted(__import__("itertools").product(*short), key=score)
    assert got == want
    top = ranked_combinations(short, lambda k, s: (unary[(k, s)],), fns, width=5)
    assert top[0] == want[0] and len(top) == 5


def test_ranked_combinations_stays_bounded_on_a_long_chain():
    """104 blocks of 3 candidates (~3^104 combinations, the segment that once exhausted memory)."""
    short = [[0, 1, 2]] * 104
    cost = {(k, s): ((k * 7 + s * 3) % 5) / 5 for k in range(104) for s in range(3)}
    tracemalloc.start()
    got = ranked_combinations(short, lambda k, s: (cost[(k, s)],), {}, width=256)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(got) == 256 and len(set(got)) == 256 and all(len(c) == 104 for c in got)
    assert got[0] == tuple(min(range(3), key=lambda s: cost[(k, s)]) for k in range(104))   # separable: exact
    assert peak < 20e6, peak
    # the width shrinks only on very long segments, keeping the beam's picks bounded, down to a floor
    assert beam_width(8192, 104) == 8192 and beam_width(8192, 100_000) * 100_000 <= 1 << 23
    assert beam_width(8192, 10 ** 9) == 16


def test_profiler_candidates_of_a_long_segment_are_bounded():
    """A segment of 60 different layers (no repeats, no scopes: one segment) is ranked by the beam."""
    dims = [16 + 8 * (i % 7) + i for i in range(61)]

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x ** 2)
    ws = [jnp.full((dims[i], dims[i + 1]), 0.01) for i in range(60)]
    analysis, _ = analyze_with_program(jax.grad(loss), "2x4", ws, jnp.ones((16, dims[0])))
    seg = max(analysis.segments, key=lambda s: s.stop - s.start)
    assert seg.stop - seg.start == 60
    choices, rule = candidate_choices(analysis, seg, ProfileOptions(max_combinations=6, pool_limit=64, progress=False))
    assert "beam of width 64" in rule and 1 < len(choices) <= 6 and len(set(choices)) == len(choices)
    uniform = data_parallel_choice(analysis.graph, analysis.blocks)
    assert choices[0] == tuple(uniform[b] for b in seg.blocks)
    assert all(0 <= s < len(analysis.blocks[b].strategies) for c in choices for b, s in zip(seg.blocks, c))


# Measured on this host (3 SGD steps, lr 0.1; 4 random plans of the remat model, both cond/while plans):
# sharded vs unsharded losses agree to 1.4e-7 relative and parameters to 1.2e-7 absolute. The bounds leave
# 70x and 80x for other CPUs' summation orders and stay far below what a wrong plan changes (a gradient
# missing one shard's sum moves parameters by ~lr * grad ~ 1e-3).
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5


def _train(step, args, steps=3):
    return train(step, args, steps)[:2]


def _assert_trains_like(step, ref_step, args):
    got, got_p = _train(step, args)
    want, want_p = _train(jax.jit(ref_step), args)
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    for a, b in zip(jax.tree_util.tree_leaves(got_p), jax.tree_util.tree_leaves(want_p)):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=PARAM_ATOL)


def test_search_on_a_remat_model_trains_like_the_unsharded_step():
    step, args = _linen_problem(remat=True)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    searched = cfp.autoshard(step, mesh, *args, profiler="estimate", gpu="H100-SXM", max_combinations=2,
                             top_k=1, verify=1, iters=3)
    assert len(searched.analysis.blocks) == 17      # 8 per layer and the head, as the plain twin
    _assert_trains_like(searched, step, args)


def test_a_resharding_plan_on_a_remat_model_trains_like_the_unsharded_step():
    """Every block on its own random strategy: layouts change inside the recomputation and at the barrier."""
    step, args = _linen_problem(remat=True)
    analysis, program = analyze_with_program(step, "2x4", *args)
    rng = np.random.default_rng(0)
    choice = [int(rng.integers(len(b.strategies))) for b in analysis.blocks]
    sharded = apply_choice(program, analysis, choice)
    assert not sharded.rematerializations(*args)
    _assert_trains_like(sharded, step, args)


def _control_flow_problem():
    """A step with a `cond` in the differentiated forward and a `while_loop` on its gradients: both stay opaque."""
    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["w1"])
        h = jax.lax.cond(jnp.sum(p["w1"]) > 0, lambda a: a * 2.0, lambda a: jnp.sin(a), h)
        return jnp.mean((h @ p["w2"] - y) ** 2)

    def step(p, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        # halve the gradients until their norm is below 1 (a while loop cfp cannot see through)
        scale = jax.lax.while_loop(lambda s: s * optax.tree.norm(g) > 1.0, lambda s: s / 2.0, jnp.float32(1.0))
        g = jax.tree_util.tree_map(lambda a: a * scale, g)
        return loss, jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), opt_state
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"w1": jax.random.normal(k[0], (32, 64)) * 0.3, "w2": jax.random.normal(k[1], (64, 16)) * 0.3}
    return step, (p, (), jax.random.normal(k[2], (16, 32)), jax.random.normal(k[3], (16, 16)))


def test_cond_and_while_stay_opaque_and_the_step_runs_with_a_plan():
    step, args = _control_flow_problem()
    analysis, program = analyze_with_program(step, "2x4", *args)
    opaque = {op.primitive for op in analysis.graph.opaque_operators}
    assert {"cond", "while"} <= opaque
    assert len(analysis.blocks) == 2
    for choice in (data_parallel_choice(analysis.graph, analysis.blocks),
                   tuple(len(b.strategies) - 1 for b in analysis.blocks)):
        _assert_trains_like(apply_choice(program, analysis, choice), step, args)
