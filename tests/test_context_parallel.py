"""Context parallelism at degrees 2 and 4, with and without packing, against single-device references.

Attention (`cfp.models.attention.cp_attention`, ring and gather): outputs and gradients equal the unsharded
`dot_product_attention` with the same causal and segment masks. Runtime stages with cp > 1 (`HeteroTrainer` on
a `Layout` whose stages are cp x tp grids): the loss and the full gradient of a step equal the model's own
`apply` on one device -- fixed-length rows (no segment ids: plain causal attention over each row, split over the
ring) and packed rows (several sequences per row: each must see only itself, its positions restarting at 0).
A ring that skips a step, a mask that ignores segments or positions, or a stage that drops a chunk's tokens
misses by far more than the float32 reordering noise the tolerances allow (see each TOL).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cfp.layout import Layout, Pipeline, Stage
from cfp.mesh import MeshSpec
from cfp.models.attention import ContextParallel, CpMethod, cp_attention, dot_product_attention

# O(1) outputs of softmax rows over <= 64 keys in float32: online (ring) vs one-shot summation differ by a few
# ulps; 64 eps leaves room for any SIMD summation order (as tests/test_data_cp.py)
ATTN_TOL = 64 * float(np.finfo(np.float32).eps)


def _attention_inputs(seq: int):
    """q, k, v [2, seq, heads, dim] (grouped-query: 4 query heads on 2 kv heads), and the segment ids and
    positions of rows packed with three sequences whose edges fall inside the devices' chunks (row 1 holds
    them in the other order); positions restart at 0 with each sequence."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(k1, (2, seq, 4, 8))
    k = jax.random.normal(k2, (2, seq, 2, 8))
    v = jax.random.normal(k3, (2, seq, 2, 8))
    lens = [seq // 4 + 3, seq // 2 - 5]
    lens.append(seq - sum(lens))
    rows = [list(enumerate(lens, 1)), list(enumerate(lens, 1))[::-1]]
    seg = np.stack([np.concatenate([np.full(n, i) for i, n in row]) for row in rows])
    pos = np.stack([np.concatenate([np.arange(n) for _, n in row]) for row in rows])
    return q, k, v, jnp.asarray(seg), jnp.asarray(pos)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", [CpMethod.RING, CpMethod.GATHER])
@pytest.mark.parametrize("packed", [False, True])
def test_cp_attention_equals_single_device_attention(cp, method, packed):
    seq = 48
    q, k, v, seg, pos = _attention_inputs(seq)
    if not packed:
        seg = pos = None
    # heads over the other mesh axis where its size divides the 2 kv heads
    mesh = MeshSpec((cp, 8 // cp), ("cp", "tp")).make()
    ctx = ContextParallel(mesh, "cp", method, head_axis="tp" if 2 % (8 // cp) == 0 else None)

    def sharded(q, k, v):
        return cp_attention(q, k, v, ctx, True, seg, pos)

    def single(q, k, v):
        return dot_product_attention(q, k, v, True, seg)

    out, want = jax.jit(sharded)(q, k, v), single(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    assert float(jnp.max(jnp.abs(out - want))) <= ATTN_TOL
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(loss(single), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, ref):
        assert np.isfinite(np.asarray(a)).all()
        assert float(jnp.max(jnp.abs(a - b))) <= ATTN_TOL * max(1.0, float(jnp.max(jnp.abs(b))))
    # not vacuous: attention confined to each device's chunk (no exchange) is far off
    chunk = jnp.broadcast_to(jnp.arange(seq) // (seq // cp), (2, seq)) + (0 if seg is None else 10 * seg)
    assert float(jnp.max(jnp.abs(dot_product_attention(q, k, v, True, chunk) - want))) > 1000 * ATTN_TOL


# ----------------------------------------------------------------------------- runtime stages with cp > 1
MODEL = "llama2"
SEQ = 128   # the packed rows' width: cfp.data.batching.MIN_BUCKET
# the loss and gradient of a step against the single-device model: float32 reordering (the ring's online
# softmax, TP all-reduces, summing micro-batches) measured 1e-7..6e-7 normwise on such steps
# (tests/test_data_switch.py: 4-5e-7); a dropped chunk or a mask error is off by > 1e-2
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    from cfp.models import build_model, get_config, init_params
    cfg = get_config(MODEL, "tiny", seq_len=SEQ)
    return cfg, init_params(MODEL, cfg, 0), build_model(MODEL, cfg)


def _sequences():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, n + 1).astype(np.int32) for n in (40, 50, 30, 25, 60, 35, 70, 45)]


def _fixed_batch(rows: int):
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 256, (rows, SEQ + 1)).astype(np.int32)
    weights = (rng.random((rows, SEQ)) > 0.2).astype(np.float32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "weights": weights}


def _reference(model, batch_rows: list[dict]):
    """(loss, gradient) of the model on one device: token cross-entropy over every row (a packed row is first
    unpacked into one row per sequence, each from position 0) / the weights' sum."""
    cfg, params, net = model
    rows = []
    for b in batch_rows:
        if "segment_ids" not in b:
            rows += [(b["inputs"][r], b["targets"][r], b["weights"][r]) for r in range(b["inputs"].shape[0])]
            continue
        for r in range(b["inputs"].shape[0]):
            for s in set(b["segment_ids"][r].tolist()) - {0}:
                sel = b["segment_ids"][r] == s
                pad = SEQ - int(sel.sum())
                rows.append(tuple(np.pad(b[k][r][sel], (0, pad)) for k in ("inputs", "targets", "weights")))
    x, y, w = (np.stack([r[i] for r in rows]) for i in range(3))

    def loss(p):
        logits, _ = net.apply(p, x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return jnp.sum(ce * w) / np.sum(w)
    return jax.jit(jax.value_and_grad(loss))(params)


def _rel(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    diff = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
    return (diff / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)) ** 0.5


def _layout(cp: int, tp: int, stages: int, rows: int, chunks: int, layers: int) -> Layout:
    per = cp * tp
    split = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    return Layout((Pipeline(tuple(Stage(tuple(range(s * per, (s + 1) * per)), n, cp=cp)
                                  for s, n in enumerate(split)), rows, chunks),))


@pytest.mark.parametrize("cp, tp, stages", [(2, 1, 1), (4, 1, 1), (2, 2, 2)])
def test_cp_stages_equal_the_single_device_model(model, cp, tp, stages):
    """One step's loss and gradient on fixed-length rows (2 micro-batches of 2 rows) and on packed rows (each
    micro-batch one row of several sequences) through stages of cp x tp devices: degree 2 and 4 alone, and 2
    beside TP 2 in a pipeline of 2 stages (the activations between CP stages)."""
    from cfp.data.batching import materialize
    from cfp.models.layered import zoo_full_params, zoo_params
    from cfp.runtime.engine import zoo_trainer
    cfg, full, _ = model
    params = zoo_params(full, cfg.num_layers)
    tr = zoo_trainer(MODEL, cfg, _layout(cp, tp, stages, 4, 2, cfg.num_layers))
    fixed = _fixed_batch(4)
    seqs = _sequences()
    packed = [[materialize(seqs, ids, packed=True) for ids in ([0, 1, 2], [3, 4, 5], [6, 7])]]
    assert all(mb["inputs"].shape == (1, SEQ) and mb["segment_ids"].max() >= 2 for mb in packed[0])
    for batch, rows in ((fixed, [fixed]), (packed, packed[0])):
        tr.load_state(params, tr.tx.init(params), 0)
        grads, loss = tr.gradients(batch)
        grads = zoo_full_params(grads)
        ref_loss, ref_grads = _reference(model, rows)
        assert np.isfinite(loss) and abs(loss - float(ref_loss)) <= TOL * abs(float(ref_loss)), (loss, ref_loss)
        assert _rel(grads, ref_grads) <= TOL
