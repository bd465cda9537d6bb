"""`lax.scan` seen through: a scanned model's body gives the blocks and segment of one unrolled layer, plans apply
inside the loop with the stacked layer dim left whole, gradient accumulation over micro-batches is analysed,
and `cond`/`while_loop` stay opaque but run."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from cfp.analysis.analysis import Analysis, analyze_with_program
from cfp.analysis.blocks import data_parallel_choice, trace_view
from cfp.analysis.loops import stacked_dims
from cfp.baselines.uniform import dp_tp_choice
from cfp.hardware.gpus import get_gpu
from cfp.ir.state import state_pairs
from cfp.profiling.options import ProfileOptions
from cfp.profiling.profiler import profile
from cfp.profiling.subprogram import SegmentPart, SegmentProgram, segment_io
from cfp.search.loop_figures import LoopBodies
from cfp.search.search import _candidate_rows
from cfp.sharding.step import apply_choice
from cfp.xla.compiled import compiled_figures
from programs import MlpStack, lm_step_problem, train, two_layer_mlp

DIM, SEQ, BATCH, VOCAB, LAYERS, STEPS = 16, 4, 8, 32, 3, 3
# Measured on this host (3 Adam steps, lr 1e-2, fp32, DP x TP and data parallel, with and without sharded
# state): sharded vs unsharded losses agree to 1.1e-7 relative, parameters and optimizer state to 4.2e-6
# absolute (Adam's division by the gradients' RMS magnifies summation-order noise). The bounds leave 90x and
# 24x for other CPUs' summation orders and stay far below one step's size (1e-2).
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-4


def _problem(scanned: bool):
    return lm_step_problem(MlpStack(VOCAB, DIM, LAYERS, scanned), optax.adam(1e-2), BATCH, SEQ, VOCAB)


@pytest.fixture(scope="module")
def scanned():
    step, args = _problem(True)
    analysis, program = analyze_with_program(step, "2x4", *args)
    return step, args, analysis, program


def test_the_scan_body_gives_the_blocks_and_segment_of_one_unrolled_layer(scanned):
    _, _, a, _ = scanned
    step, args = _problem(False)
    twin, _ = analyze_with_program(step, "2x4", *args)
    assert not a.graph.opaque_operators and len(a.graph.loops) == 2       # the forward and the backward scan
    assert Analysis.from_json(a.to_json()) == a                             # loops and repeats are saved
    body = [s for s in a.segments if s.repeat > 1]
    assert [s.repeat for s in body] == [LAYERS]
    layers = [s for s in twin.segments if s.kind == twin.segments[0].kind]
    assert len(layers) == LAYERS and all(s.repeat == 1 for s in twin.segments)
    # the body's segment is an unrolled layer's: same blocks (dots, their backward pairs), same fingerprint
    assert body[0].fingerprint == layers[0].fingerprint
    fps = [b.fingerprint for b in a.blocks]
    twin_fps = [b.fingerprint for b in twin.blocks]
    assert fps[body[0].start:body[0].stop] == twin_fps[layers[0].start:layers[0].stop]
    assert len(a.blocks) == len(twin.blocks) - (LAYERS - 1) * (layers[0].stop - layers[0].start)
    for b in a.blocks[body[0].start:body[0].stop]:
        assert len(b.dots) == 3      # forward, and its data and weight gradients in the backward scan
        # no strategy sees the stacked layer dim: the body's dot reads one layer's slice of the stacked kernel
        g, fwd = a.graph, a.graph.operators[b.forward.op]
        w = g.tensor(fwd.inputs[1])
        src, dims = trace_view(g, w.id)
        assert src in g.inputs and g.tensor(src).shape == (LAYERS,) + w.shape and dims == (1, 2)


def _stacked_inputs(a):
    return [i for i, p in enumerate(a.graph.input_paths) if "layers" in p and "kernel" in p]


@pytest.mark.parametrize("shard_state", [False, True])
def test_a_plan_applied_inside_the_scan_trains_like_the_unsharded_step(scanned, shard_state):
    step_fn, args, a, program = scanned
    choice = dp_tp_choice(a)
    assert choice is not None and choice != data_parallel_choice(a.graph, a.blocks)
    step = apply_choice(program, a, choice, shard_state=shard_state)
    stacked = _stacked_inputs(a)
    assert len(stacked) == 6      # two stacked kernels, their Adam mu and nu
    specs = [step.shardings.input_specs[i] for i in stacked]
    # the stacked layer dim is never sharded (by a strategy or by state sharding); the other dims are
    assert all(len(s) == 0 or s[0] is None for s in specs) and any(any(e is not None for e in s) for s in specs)
    assert all(a.graph.tensor(a.graph.inputs[i]).shape[0] == LAYERS for i in stacked)
    # the blocks' layouts are imposed inside the loop body
    assert re.search(r'op_name="[^"]*while/body[^"]*cfp_b\d+', step.compile(*args).as_text())
    ref = train(jax.jit(step_fn), args, STEPS)
    got = train(step, step.shard_args(*args), STEPS)
    assert all(np.isfinite(got[0]))
    np.testing.assert_allclose(got[0], ref[0], rtol=LOSS_RTOL)
    for x, y in zip(jax.tree_util.tree_leaves(got[1:]), jax.tree_util.tree_leaves(ref[1:])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=PARAM_ATOL, rtol=0)


def _deep_narrow_problem(layers=16, width=8):
    """A scan over 16 stacked 8x8 layers with momentum SGD: the layer dim is each state tensor's largest."""
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    w = jax.random.normal(k[0], (layers, width, width)) / width ** .5
    opt = optax.sgd(0.1, momentum=0.9)

    def step(w, s, x):
        def loss(w):
            h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
            return jnp.mean(h ** 2)
        l, g = jax.value_and_grad(loss)(w)
        u, s = opt.update(g, s, w)
        return l, optax.apply_updates(w, u), s
    return step, (w, opt.init(w), jax.random.normal(k[1], (16, width)))


def test_stacked_specs_leave_the_layer_dim_whole_under_every_strategy():
    step_fn, args = _deep_narrow_problem()
    a, program = analyze_with_program(step_fn, "2x4", *args)
    (w_in, w_out), (m_in, m_out) = state_pairs(a.graph)
    stacked = (w_in, m_in)
    assert all(stacked_dims(a.graph)[a.graph.inputs[i]] == {0} for i in stacked)
    (block,) = a.blocks
    for k in range(len(block.strategies)):
        for shard in (False, True):
            specs = apply_choice(program, a, (k,), shard_state=shard).shardings.input_specs
            assert all(len(specs[i]) == 0 or specs[i][0] is None for i in stacked), (k, shard, specs)
    # state sharding puts the free axes on a layer's own dims, though the layer dim is the largest
    fsdp = apply_choice(program, a, data_parallel_choice(a.graph, a.blocks), shard_state=True)
    assert [fsdp.shardings.input_specs[i] for i in stacked] == [P(None, ("x0", "x1"))] * 2
    got, ref = fsdp(*args), jax.jit(step_fn)(*args)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_a_body_segment_counts_its_trip_count_in_the_search(scanned):
    _, _, a, _ = scanned

    class Entry:
        def __init__(self, t, m):
            self.time, self.memory, self.choice = t, m, ()
    segs = a.segments
    _, cost, mem = _candidate_rows(segs, [[Entry(1.0, 100)] for _ in segs], None, 1.0, 1.0)
    assert [c[0] for c in cost] == [float(s.repeat) for s in segs]
    assert [m[0] for m in mem] == [100 * s.repeat for s in segs]


def _accumulation_problem(micro=4):
    """An SGD step that scans over micro-batches, summing their gradients in the carry."""
    p, x, y, loss = two_layer_mlp()
    opt = optax.sgd(0.1)

    def step(p, s, x, y):
        def one(acc, xy):
            l, g = jax.value_and_grad(loss)(p, *xy)
            return jax.tree_util.tree_map(jnp.add, acc, (l, g)), None
        zero = (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, p))
        (l, g), _ = jax.lax.scan(one, zero, (x.reshape(micro, -1, 32), y.reshape(micro, -1, 32)))
        u, s = opt.update(jax.tree_util.tree_map(lambda v: v / micro, g), s, p)
        return l / micro, optax.apply_updates(p, u), s
    return step, (p, opt.init(p), x, y)


def test_gradient_accumulation_over_micro_batches_is_analysed():
    step_fn, args = _accumulation_problem()
    a, program = analyze_with_program(step_fn, "2x4", *args)
    assert len(a.blocks) == 2 and not a.graph.opaque_operators
    assert all(s.repeat == 4 for s in a.segments)
    # each forward dot with its gradients (the first layer's input needs none)
    assert [len(b.dots) for b in a.blocks] == [2, 3]
    step = apply_choice(program, a, data_parallel_choice(a.graph, a.blocks))
    x_pos = len(jax.tree_util.tree_leaves(args[:2]))
    # each device receives its share of every micro-batch, not the whole global batch
    assert step.shardings.input_specs[x_pos:] == (P(("x0", "x1")),) * 2
    got, ref = step(*args), jax.jit(step_fn)(*args)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_cond_and_while_loop_stay_opaque_and_run():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    w, x = jax.random.normal(k[0], (32, 32)) * .1, jax.random.normal(k[1], (16, 32))

    def step(w, x):
        def loss(w):
            h = jnp.tanh(x @ w)
            h = jax.lax.cond(h.sum() > 0, lambda v: v * 2.0, lambda v: v - 1.0, h)
            return jnp.mean((h @ w) ** 2)
        l, g = jax.value_and_grad(loss)(w)
        # halve the gradient until its largest entry is at most 1e-3 (a data-dependent trip count)
        g = jax.lax.while_loop(lambda v: jnp.abs(v).max() > 1e-3, lambda v: v * 0.5, g)
        return l, w - 0.1 * g
    a, program = analyze_with_program(step, "2x4", w, x)
    assert sorted(op.primitive for op in a.graph.opaque_operators) == ["cond", "cond", "while"]
    assert a.blocks
    got = apply_choice(program, a, data_parallel_choice(a.graph, a.blocks))(w, x)
    for u, v in zip(got, jax.jit(step)(w, x)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)


def test_whole_step_flops_count_every_iteration_of_the_loop(scanned):
    """XLA counts a while loop's body once; with the body segment's other iterations added, the scanned step's
    FLOPs are its unrolled twin's (the same arithmetic, compiled without a loop). Measured: 1.1% apart (the
    body's few operators outside blocks are counted once); counting the body once is 43% short."""
    _, args, a, program = scanned
    mesh = a.mesh.make()
    table = profile(program, a, ProfileOptions(kind="estimate", gpu="H100-SXM", max_combinations=1),
                    log=lambda *_: None)
    dp = data_parallel_choice(a.graph, a.blocks)
    flops = compiled_figures(apply_choice(program, a, dp).compile(*args), a.mesh.shape).flops
    extra_t, extra_flops = LoopBodies(program, a, table, get_gpu("H100-SXM"), mesh).extra(dp)
    step, twin_args = _problem(False)
    twin, twin_program = analyze_with_program(step, "2x4", *twin_args)
    twin_step = apply_choice(twin_program, twin, data_parallel_choice(twin.graph, twin.blocks))
    twin_flops = compiled_figures(twin_step.compile(*twin_args), a.mesh.shape).flops
    assert flops < 0.8 * twin_flops and extra_t > 0
    assert abs(flops + extra_flops - twin_flops) / twin_flops < 0.05, (flops, extra_flops, twin_flops)


def test_nnx_scan_over_vmapped_layers_is_seen_through():
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(DIM, 4 * DIM, rngs=rngs), nnx.Linear(4 * DIM, DIM, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Layer(rngs)
            self.layers, self.head = make(rngs), nnx.Linear(DIM, 8, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, layer):
                return layer(x)
            return self.head(body(x, self.layers))

    graphdef, params = nnx.split(Net(nnx.Rngs(0)))
    opt = optax.adam(1e-2)

    def step(params, opt_state, x, y):
        l, g = jax.value_and_grad(lambda p: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2))(params)
        u, opt_state = opt.update(g, opt_state, params)
        return l, optax.apply_updates(params, u), opt_state
    k = jax.random.split(jax.random.PRNGKey(1))
    args = (params, opt.init(params), jax.random.normal(k[0], (BATCH, DIM)), jax.random.normal(k[1], (BATCH, 8)))
    a, program = analyze_with_program(step, "2x4", *args)
    assert [s.repeat for s in a.segments] == [LAYERS, 1] and not a.graph.opaque_operators
    sharded = apply_choice(program, a, dp_tp_choice(a), shard_state=True)
    stacked = [i for i, p in enumerate(a.graph.input_paths) if "layers" in p]
    assert len(stacked) == 3 * 4 and all(sharded.shardings.input_specs[i][0] is None for i in stacked)
    ref = train(jax.jit(step), args, STEPS)
    got = train(sharded, sharded.shard_args(*args), STEPS)
    np.testing.assert_allclose(got[0], ref[0], rtol=LOSS_RTOL)
    for x, y in zip(jax.tree_util.tree_leaves(got[1:]), jax.tree_util.tree_leaves(ref[1:])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=PARAM_ATOL, rtol=0)


def test_part_of_a_scanned_step_replays_with_its_whole_loop(scanned):
    """`replay_part` (the pipeline stages' entry) computes an output behind a scan by running the loop whole."""
    step_fn, args, _, program = scanned
    flat = jax.tree_util.tree_leaves(args)
    ref = jax.tree_util.tree_leaves(jax.jit(step_fn)(*args))
    last = len(program.graph.outputs) - 1      # a stacked parameter's Adam moment: behind both scans
    assert "layers" in program.graph.output_paths[last]
    for outs in ([0], [last]):
        got = program.replay_part(dict(enumerate(flat)), outs)
        for g, o in zip(got, outs):
            np.testing.assert_allclose(np.asarray(g), np.asarray(ref[o]), rtol=1e-5, atol=1e-6)


def test_a_body_segment_profile_holds_its_layers_share_of_the_stacked_update(scanned):
    """The stacked parameters' optimizer update runs once per step outside the loop; the body's segment holds
    one layer's share of it (on slices), so counted per iteration its cost is an unrolled layer's, update
    included. Compiled FLOPs under data parallel (measured): the body 88412 per device, the unrolled twin's
    middle layer 89404 (1.1% apart); the body without the update 61628 (31% short)."""
    _, _, a, program = scanned
    g, body = a.graph, a.segments[0]
    update = segment_io(a, body, SegmentPart.UPDATE)
    assert update.ops and all(g.repeat(o) == 1 and not g.operators[o].is_dot for o in update.ops)
    assert all(dict(update.sliced)[t] == 0 for o in update.ops for t in g.operators[o].outputs if t is not None)
    assert set(update.ops) | set(segment_io(a, body, SegmentPart.ITERATION).ops) <= set(segment_io(a, body).ops)
    mesh = a.mesh.make()

    def flops(analysis, prog, seg, part=SegmentPart.ALL):
        dp = data_parallel_choice(analysis.graph, analysis.blocks)
        sp = SegmentProgram(prog, analysis, seg, tuple(dp[b] for b in seg.blocks), mesh, part)
        return compiled_figures(sp.compile(), analysis.mesh.shape).flops
    step, twin_args = _problem(False)
    twin, twin_program = analyze_with_program(step, "2x4", *twin_args)
    # a middle layer: the first also holds the embedding's operators, the last the head's
    layer = flops(twin, twin_program, twin.segments[1])
    assert flops(a, program, body) == pytest.approx(layer, rel=0.03)
    assert flops(a, program, body, SegmentPart.ITERATION) < 0.8 * layer
