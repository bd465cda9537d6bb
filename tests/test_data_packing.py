"""Packed micro-batches (segment ids, restarting positions, packed causal attention) give the loss and gradients
of the sequences run one by one; materialisation puts every real token in exactly once. What the attention
computes on a packed row, against the compiled program's FLOPs: tests/test_packed_attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cfp.data.batching import materialize
from cfp.models import build_model, get_config, init_params

EPS32 = float(np.finfo(np.float32).eps)
# Same tokens, different summation order (the packed row sums ~100 terms where each sequence sums its own, and
# its attention rows hold more masked entries): float32 reordering error of a sum of n terms is bounded by
# ~n·eps relative; 512·eps ≈ 6e-5 covers n up to 512 with margin on any SIMD width.
REL_TOL = 512 * EPS32

LENGTHS = (37, 21, 5, 40, 15)   # 118 real tokens in one 128-token row (four 32-token attention blocks)
# two 384-token rows (twelve 32-token attention blocks; sequences span several, and start inside a block)
LONG = (300, 100, 41, 90)


def _seqs(lengths=LENGTHS):
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, n + 1).astype(np.uint8) for n in lengths]


def _sum_ce(model, params, mb, packed):
    kw = {"segment_ids": mb["segment_ids"], "positions": mb["positions"]} if packed else {}
    logits, _ = model.apply(params, jnp.asarray(mb["inputs"]), **kw)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(mb["targets"]))
    return jnp.sum(ce * mb["weights"])


def _unpacked(model, params, seqs):
    """Each sequence alone in its own row, padded after its end (causal: padding cannot reach it), dense
    attention (no segment ids)."""
    mb = materialize(seqs, list(range(len(seqs))), packed=False)
    return _sum_ce(model, params, mb, packed=False) / sum(s.size - 1 for s in seqs)


CASES = {"gpt": {}, "llama2": {},
         # capacity = group size, no aux loss: routing is per token, so grouping cannot change the result
         "moe": {"capacity_factor": 4.0, "aux_loss_coef": 0.0}}


@pytest.mark.parametrize("name,lengths", [(n, LENGTHS) for n in sorted(CASES)] + [("llama2", LONG)])
def test_packed_loss_and_grads_equal_unpacked(name, lengths):
    cfg = get_config(name, "tiny", seq_len=384 if lengths == LONG else 128, **CASES[name])
    model = build_model(name, cfg)
    # 4x the init scale sharpens attention, so attending across sequences would change the loss clearly
    params = jax.tree_util.tree_map(lambda x: 4 * x, init_params(name, cfg, 0))
    seqs = _seqs(lengths)
    row = materialize(seqs, list(range(len(seqs))), packed=True)
    assert row["inputs"].shape == ((1, 128) if lengths == LENGTHS else (2, 384))
    assert row["weights"].sum() == sum(lengths)

    packed = lambda p: _sum_ce(model, p, row, True) / sum(lengths)
    unpacked = lambda p: _unpacked(model, p, seqs)
    both = jax.jit(lambda p: (jax.value_and_grad(packed)(p), jax.value_and_grad(unpacked)(p)))
    (lp, gp), (lu, gu) = both(params)
    assert np.isfinite(float(lp)) and np.isfinite(float(lu))
    assert abs(float(lp) - float(lu)) <= REL_TOL * abs(float(lu))
    # relative to the largest gradient entry: some entries are analytically zero (key biases under the
    # softmax's shift invariance) and hold only rounding noise
    scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree_util.tree_leaves(gu))
    for a, b in zip(jax.tree_util.tree_leaves(gp), jax.tree_util.tree_leaves(gu)):
        assert np.isfinite(np.asarray(a)).all()
        assert float(jnp.max(jnp.abs(a - b))) <= REL_TOL * scale
    # the check is sensitive: the same row without segment ids / positions is a different loss
    wrong = jax.jit(lambda p: _sum_ce(model, p, row, False))(params) / sum(lengths)
    assert abs(float(wrong) - float(lu)) > 10 * REL_TOL * abs(float(lu))


def test_materialize_packed_and_padded_rows():
    seqs = _seqs()
    row = materialize(seqs, [0, 2, 4], packed=True)
    seg, pos, w = row["segment_ids"][0], row["positions"][0], row["weights"][0]
    n = [LENGTHS[i] for i in (0, 2, 4)]
    assert row["inputs"].shape == (1, 128) and w.sum() == sum(n)
    assert list(np.bincount(seg)[1:]) == n and (w == (seg > 0)).all()
    starts = np.cumsum([0] + n[:-1])
    assert (pos[starts] == 0).all() and pos[starts[1] - 1] == n[0] - 1
    np.testing.assert_array_equal(row["inputs"][0, starts[1]:starts[1] + n[1]], seqs[2][:-1])
    np.testing.assert_array_equal(row["targets"][0, starts[1]:starts[1] + n[1]], seqs[2][1:])
    pad = materialize(seqs, [1, 3, 4], packed=False)      # one per row, rows rounded up to a power of two
    assert pad["inputs"].shape == (4, 128) and pad["weights"].sum() == LENGTHS[1] + LENGTHS[3] + LENGTHS[4]
    assert (pad["weights"][3] == 0).all() and (pad["segment_ids"][3] == 0).all()
