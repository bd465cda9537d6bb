"""Packed causal attention (`cfp.models.packed_attention`) computes only the blocks some sequence spans, and the
step breakdown and scheme fits count exactly those (`cfp.data.rows.layout_entries`).

* Numerics: on every real query the output and the gradients equal a dense masked softmax written here (float32;
  the tolerance is float32 reordering noise, see TOL), for packings of one long sequence, many short ones, a
  mix, rows of one sequence each, and a micro-batch small enough to compute every pair statically.
* Counts: the block map the kernel runs on the materialised segment ids keeps as many pairs as the host count
  from the lengths, and the entries `layout_entries` prices are the kernel's tasks x block².
* FLOPs: XLA's cost analysis counts a while loop's body once, so the executed FLOPs are the compiled program's
  plus (trips - 1) x one trip's (its forward and backward bodies compiled alone, with the trips the block map
  finds in the segment ids). The entries the breakdown counts beyond the diagonal pass price exactly those trips
  (within 2%), and the executed FLOPs are the counted entries x their dots' FLOPs times a fixed overhead
  (OVERHEAD). Comparing per-entry FLOPs more tightly would not be honest: XLA shares the diagonal pass's scores
  between forward and backward (the same tasks, computed once), the loop's trips cannot share them.
"""
from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.data.batching import materialize
from cfp.data.breakdown import compute_parts
from cfp.data.rows import arrange, layout_entries
from cfp.models import packed_attention as pa
from cfp.models.attention import attention_block, causal_pairs, dot_product_attention
from cfp.xla.compiled import compiled_cost

PACKINGS = {
    "one long": [1000],
    "many short": [60] * 16,
    "mixed": [500, 300, 120, 40, 30, 20, 9, 5],
    "one per row": [90] * 11,
    "all pairs": [37, 21, 5, 40, 15],
}
HEADS, KV, DIM = 4, 2, 8
# normwise relative error of float32 softmax attention over <= 1024 keys against the same maths in another
# summation order: measured <= 3e-7 on these packings; sqrt(1024) x eps = 3.8e-6 bounds a random-walk of
# rounding errors over the longest sums
TOL = np.sqrt(1024) * float(np.finfo(np.float32).eps)


def _batch(lengths, seed=0):
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, 256, n + 1).astype(np.uint8) for n in lengths]
    return materialize(toks, list(range(len(lengths))), True)


def _qkv(shape, seed=1):
    r, w = shape
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (2 * jax.random.normal(k1, (r, w, HEADS, DIM)), 2 * jax.random.normal(k2, (r, w, KV, DIM)),
            jax.random.normal(k3, (r, w, KV, DIM)))


def _dense(q, k, v, seg):
    """Reference: every score computed, masked to same segment and key <= query, softmax over the whole row."""
    r, w, h, d = q.shape
    kk, vv = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
    ok = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((w, w), bool))[None]
    p = jax.nn.softmax(jnp.where(ok[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv)


def _loss(attn, seg):
    real = (seg > 0)[..., None, None]
    return lambda q, k, v: jnp.sum(jnp.where(real, jnp.sin(attn(q, k, v)), 0.0))


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


@pytest.mark.parametrize("name", sorted(PACKINGS))
def test_packed_attention_equals_dense_masked_attention(name):
    mb = _batch(PACKINGS[name])
    seg = jnp.asarray(mb["segment_ids"])
    q, k, v = _qkv(seg.shape)
    real = (seg > 0)[..., None, None]
    got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, True, seg))(q, k, v)
    want = _dense(q, k, v, seg)
    assert np.isfinite(np.asarray(got)).all()
    assert _rel(jnp.where(real, got, 0), jnp.where(real, want, 0)) <= TOL
    grads = jax.jit(jax.grad(_loss(lambda q, k, v: dot_product_attention(q, k, v, True, seg), seg),
                             argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(_loss(lambda q, k, v: _dense(q, k, v, seg), seg), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, ref):
        assert np.isfinite(np.asarray(a)).all()
        assert _rel(a, b) <= TOL
    if name not in ("one long", "one per row"):   # not vacuous: attention that ignores the segments is far off
        other = dot_product_attention(q, k, v, True, jnp.where(seg > 0, 1, 0))
        assert _rel(jnp.where(real, other, 0), jnp.where(real, want, 0)) > 100 * TOL


@pytest.mark.parametrize("name", sorted(PACKINGS))
def test_block_map_keeps_the_pairs_the_host_counts(name):
    lengths = PACKINGS[name]
    mb = _batch(lengths)
    seg = jnp.asarray(mb["segment_ids"])
    r, w = seg.shape
    block = attention_block(w)
    n = w // block
    count = int(pa.block_map(seg, block)[3])
    if pa.computes_all_pairs(r, n):
        tasks = r * n * (n + 1) // 2
    else:
        tasks = r * n + -(-count // pa.TASK_CHUNK) * pa.TASK_CHUNK
    lay = arrange(lengths, True)
    total, pad = layout_entries(lay, lengths)
    assert total == tasks * block * block
    # the pairs some sequence spans, counted by brute force over the segment ids
    ids = np.asarray(seg).reshape(r, n, block)
    spans = sum(bool(set(ids[i, a][ids[i, a] > 0]) & set(ids[i, b][ids[i, b] > 0]))
                for i in range(r) for a in range(n) for b in range(a))
    assert count == spans
    parts = compute_parts(lengths, True)
    assert parts["own"] + parts["cross"] + parts["pad_entries"] == total and parts["cross"] >= 0


def _flops(fn, *shapes) -> float:
    return float(compiled_cost(jax.jit(fn).lower(*shapes).compile())["flops"])


def _trip_flops(shape, block):
    """Cost-analysis FLOPs of one loop trip (`TASK_CHUNK` tasks, forward and backward) on micro-batches of
    `shape`, its bodies compiled alone."""
    r, w = shape
    n, g = w // block, HEADS // KV
    f32, spec = jnp.float32, jax.ShapeDtypeStruct
    xs = (spec((r, n, block, KV, g, DIM), f32), spec((r, n, block, KV, DIM), f32),
          spec((r, n, block, KV, DIM), f32), spec((r, n, block), jnp.int32))
    stat, acc = spec((r, n, block, KV, g), f32), spec((r, n, block, KV, g, DIM), f32)
    tasks = tuple(spec((pa.TASK_CHUNK,), jnp.int32) for _ in range(3)) + (spec((), jnp.int32),)
    trip = _flops(lambda xs, st, tk: pa.fwd_trip(xs, 0, st, tk), xs, (stat, stat, acc), tasks)
    return trip + _flops(lambda xs, gr, tk: pa.bwd_trip(xs, 0, gr, tk), xs + (acc, stat, stat),
                         (acc, xs[1], xs[2]), tasks)


# the attention's FLOPs per score entry over its dots' (QKᵀ and PV forward, four dots backward: 12·head_dim):
# measured 1.19-1.35 on these packings (masking, exponentials, the trips' merges and scatters)
OVERHEAD = (1.0, 1.5)


@pytest.mark.parametrize("name", sorted(PACKINGS))
def test_breakdown_entries_match_the_compiled_programs_flops(name):
    lengths = PACKINGS[name]
    mb = _batch(lengths)
    seg = jnp.asarray(mb["segment_ids"])
    shape = seg.shape
    block = attention_block(shape[1])
    q, k, v = _qkv(shape)
    step = jax.jit(jax.grad(_loss(lambda q, k, v: pa.packed_causal_attention(q, k, v, seg, block), seg),
                            argnums=(0, 1, 2)))
    program = float(compiled_cost(step.lower(q, k, v).compile())["flops"])
    r, n = shape[0], shape[1] // block
    entries = layout_entries(arrange(lengths, True), lengths)[0]
    dots = 12 * DIM * HEADS
    if pa.computes_all_pairs(r, n):      # no loop: the program is what runs, every pair of every row
        assert entries == r * causal_pairs(shape[1])
        executed = program
    else:
        trip = _trip_flops(shape, block)
        trips = -(-int(pa.block_map(seg, block)[3]) // pa.TASK_CHUNK)
        executed = program + (trips - 1) * trip      # cost analysis counts a loop's body once
        # the counted entries beyond the diagonal pass are the loop's trips x TASK_CHUNK tasks of block²
        priced = lambda entries: program + ((entries / block ** 2 - r * n) / pa.TASK_CHUNK - 1) * trip
        assert abs(executed / priced(entries) - 1) <= 0.02, (executed, priced(entries))
        if len(lengths) > 1:    # not vacuous: pricing every block up to the diagonal (no map) misses by far
            assert abs(executed / priced(r * causal_pairs(shape[1])) - 1) > 0.1
    assert OVERHEAD[0] <= executed / (entries * dots) <= OVERHEAD[1], executed / (entries * dots)
