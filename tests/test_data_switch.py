"""Packed variable-length steps on the training engine, against a reference written here (each sequence alone
in its row through the model's own `apply`, no packing, pipelines, CP or TP): a mix mixing a pp=2 TP
pipeline, a CP pipeline and a TP pipeline gives the reference's loss and gradient (every pipeline's tokens
counted once, normalised by the real tokens); a mix switch moves the state exactly, and a run that
switches away and back equals one that never switched."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cfp.data.batching import materialize
from cfp.layout import Layout
from cfp.models import build_model, get_config
from cfp.models.layered import zoo_full_params, zoo_params
from programs import trainer_of, zoo_cache

MODEL = "llama2"
LR, WD = 1e-2, 0.01
A = [(1, 2, 2), (2, 1, 1), (1, 2, 1)]     # the acceptance mix: pp=2 beside pp=1, one with cp=2
B = [(1, 4, 2)]
# float32 reordering noise (packing, TP all-reduces, the ring's online softmax, pipeline sums) measured
# 4-5e-7 normwise on the gradient and 6-9e-8 on the loss (mixes A and B); a pipeline's tokens dropped
# or the sum normalised by padded slots is off by >1e-1.
TOL = 1e-5


def _seqs():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n + 1).astype(np.uint8) for n in (40, 70, 9, 100, 33, 60, 17, 50)]


def _packed(seqs, groups):
    """Per pipeline, its packed micro-batches (each a list of sequence indices)."""
    return [[materialize(seqs, ids, packed=True) for ids in pipe] for pipe in groups]


def _reference(cfg, params, seqs):
    """(loss, gradient): token cross-entropy summed over every sequence, each alone in its row from position 0
    (padded at the end with weight 0: causal attention never lets padding reach a real token) / real tokens."""
    model = build_model(MODEL, cfg)
    full = zoo_full_params(params)
    x, y, w = np.zeros((len(seqs), 128), np.int32), np.zeros((len(seqs), 128), np.int32), np.zeros((len(seqs), 128))
    for r, s in enumerate(seqs):
        x[r, :s.size - 1], y[r, :s.size - 1], w[r, :s.size - 1] = s[:-1], s[1:], 1.0

    def loss(p):
        logits, _ = model.apply(p, x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return jnp.sum(ce * w) / np.sum(w)
    value, grads = jax.jit(jax.value_and_grad(loss))(full)
    return value, zoo_params(grads, cfg.num_layers)


def _rel(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    diff = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
    norm = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)
    return (diff / norm) ** 0.5


def _host(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def setup():
    cfg = get_config(MODEL, "tiny", seq_len=128)
    cache = zoo_cache(MODEL, cfg, LR, WD)     # the trainers of one mix run the same compiled programs
    params = jax.tree_util.tree_map(np.asarray, cache.model.params)
    trainer = lambda shapes: trainer_of(cache, Layout.from_schemes(shapes, cfg.num_layers), "1f1b")
    return cfg, params, trainer


def test_heterogeneous_mix_step_equals_sequence_reference(setup):
    """Pipelines (1,2,2), (2,1,1), (1,2,1) with 2, 1 and 3 micro-batches (one a single sequence): the engine's
    loss and gradient against the reference, and one AdamW step against optax's applied to it."""
    cfg, params, trainer = setup
    seqs = _seqs()
    mbs = _packed(seqs, [[[0, 1], [2, 3]], [[4, 5]], [[6], [7], [2]]])
    used = [seqs[i] for i in (0, 1, 2, 3, 4, 5, 6, 7, 2)]
    tr = trainer(A)
    tr.load_state(params, tr.tx.init(params), 0)
    grads, loss = tr.gradients(mbs)
    ref_loss, ref_grads = _reference(cfg, params, used)
    assert np.isfinite(loss) and abs(loss - float(ref_loss)) <= TOL * abs(float(ref_loss))
    assert _rel(grads, ref_grads) <= TOL
    st = tr.step(mbs)
    assert st.real_tokens == sum(s.size - 1 for s in used) and st.tokens == 6 * 128
    tx = optax.adamw(LR, weight_decay=WD)
    upd, _ = tx.update(ref_grads, tx.init(params), params)
    want = optax.apply_updates(params, upd)
    # Adam's first step moves every element by ~lr, dividing by |g| (near-zero gradients amplify rounding):
    # compare the moves, normwise (measured 7e-5 on A and B)
    moved = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - np.asarray(b), tr.state()[0], params)
    want_moved = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - np.asarray(b), want, params)
    assert _rel(moved, want_moved) <= 1e-3


def test_a_pipeline_without_micro_batches_adds_nothing(setup):
    """A step in which dispatch gave pipeline 1 nothing: the gradient is the other pipelines' tokens only."""
    cfg, params, trainer = setup
    seqs = _seqs()
    tr = trainer(A)
    tr.load_state(params, tr.tx.init(params), 0)
    grads, loss = tr.gradients(_packed(seqs, [[[0, 1]], [], [[3]]]))
    ref_loss, ref_grads = _reference(cfg, params, [seqs[0], seqs[1], seqs[3]])
    assert abs(loss - float(ref_loss)) <= TOL * abs(float(ref_loss)) and _rel(grads, ref_grads) <= TOL


def test_switch_is_exact_and_switching_back_changes_nothing(setup):
    cfg, params, trainer = setup
    seqs = _seqs()
    steps = [[[[0, 1], [2]], [[3]], [[4, 5]]], [[[6]], [[7, 0]], [[1, 2]]], [[[3, 6]], [[5]], [[4, 7]]]]
    as_b = lambda groups: [[ids for pipe in groups for ids in pipe]]   # the same micro-batches on B's pipeline
    plain, switched, other = trainer(A), trainer(A), trainer(A)
    for t in (plain, switched, other):
        t.load_state(params, t.tx.init(params), 0)
    losses = {"plain": [], "other": []}
    for k, groups in enumerate(steps):
        if k == 1:
            before = _host(switched.state()[0]) + _host(switched.state()[1])
            assert switched.set_layout(Layout.from_schemes(B, cfg.num_layers))
            after = _host(switched.state()[0]) + _host(switched.state()[1])
            assert all(np.array_equal(a, b) for a, b in zip(before, after))
            assert set(switched.layout.devices) == set(range(8))
            switched.set_layout(Layout.from_schemes(A, cfg.num_layers))    # ... and back
            other.set_layout(Layout.from_schemes(B, cfg.num_layers))       # trains step 2 under B
        losses["plain"].append(plain.step(_packed(seqs, groups)).loss)
        switched.step(_packed(seqs, groups))
        on_b = other.layout.schemes == B
        losses["other"].append(other.step(_packed(seqs, as_b(groups) if on_b else groups)).loss)
        if k == 1:
            other.set_layout(Layout.from_schemes(A, cfg.num_layers))
    for a, b in zip(_host(plain.state()[0]), _host(switched.state()[0])):
        assert np.array_equal(a, b)            # bit-identical: a switch only copies
    assert abs(losses["other"][1] - losses["plain"][1]) <= TOL * abs(losses["plain"][1])
    assert abs(losses["other"][2] - losses["plain"][2]) <= 1e-4 * abs(losses["plain"][2])
    assert _rel(other.state()[0], plain.state()[0]) <= 1e-4     # one step's params: measured 1.3e-5 normwise
    assert all(np.isfinite(v) for vs in losses.values() for v in vs)
    assert _rel(plain.state()[0], params) > 1e-2               # training did change the parameters


def test_warm_leaves_nothing_to_compile_after_a_switch_into_stages_warmed_elsewhere(setup):
    """Mix C's first pipeline is mix A's first, stage for stage: its shapes were warmed under A, but under C its
    gradients sync with other pipelines. `warm` must still leave C's step nothing to trace or compile (it once
    keyed warmed shapes by the pipeline's stages alone: a step on C then compiled its sync, 3-4 s timed)."""
    cfg, params, trainer = setup
    seqs = _seqs()
    groups = [[[0, 1], [2]], [[3]], [[4, 5]]]
    c_mix = [(1, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1)]
    tr = trainer(A)
    tr.load_state(params, tr.tx.init(params), 0)
    mbs = _packed(seqs, groups)
    tr.warm(mbs)
    tr.step(mbs)
    tr.set_layout(Layout.from_schemes(c_mix, cfg.num_layers))
    assert tr.layout.pipelines[0].stages == trainer(A).layout.pipelines[0].stages   # the premise
    mbs = _packed(seqs, [[[0, 1], [2]], [[3]], [[4]], [[5]], [[6]]])
    tr.warm(mbs)
    events, recording = [], [False]
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.append(name) if recording[0] else None)
    recording[0] = True
    try:
        tr.step(mbs)
    finally:
        recording[0] = False
    compiled = [e for e in events if e.startswith("/jax/core/compile/")]
    assert not compiled, compiled
