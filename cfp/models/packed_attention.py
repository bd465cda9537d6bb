"""Causal attention over packed rows that computes only the blocks it keeps.

A row [S] of packed sequences (segment ids, 0 = padding; each sequence contiguous, as `cfp.data.rows` lays them
out) is cut into `attention_block(S)`-long blocks. Query block i needs key block j < i only where a sequence
spans both; every block needs its own diagonal block (causally masked). So the kernel computes

* every diagonal block of every row at once (one batched task per block, padding blocks included), then
* the off-diagonal blocks the step's **block map** keeps -- pairs (i, j) whose sets of segment ids overlap,
  found from the segment ids in the program -- in a loop with a dynamic trip count, `TASK_CHUNK` pairs per trip
  (the last trip's unused pairs are computed masked: at most `TASK_CHUNK - 1` blocks per micro-batch),

merging them with an online softmax (float32 running max, sum and output per query). A row of k sequences
costs about the sum of the k sequences' own causal blocks. The backward pass (`jax.custom_vjp`) recomputes each
task's probabilities from the saved log-sum-exp (FlashAttention's recipe) over the same tasks. The map is
conservative for any segment ids (ids whose ranges overlap keep the pair), exact for contiguous ones;
`cfp.data.rows.kernel_blocks` counts the same tasks from a row's sequence lengths on the host, so the step
breakdown and the scheme fits price what runs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MASK_VALUE = -1e9   # finite: a masked score's probability underflows to exactly 0
TASK_CHUNK = 32     # off-diagonal block pairs per loop trip
_BIG = np.int32(2 ** 30)


def off_diagonal_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (query block i, key block j) pairs with j < i of a row of n blocks, in `np.tril_indices` order."""
    return np.tril_indices(n, -1)


def block_map(segment_ids, block: int):
    """The off-diagonal block pairs the kernel computes for rows `segment_ids` [B, S]: (rows, query blocks, key
    blocks) int32 [B·P rounded up to whole trips] (P the static pairs per row; the kept ones first, in row-major
    order) and the count kept.
    A pair is kept where the query and key blocks' ranges of nonzero segment ids overlap."""
    b, s = segment_ids.shape
    seg = segment_ids.reshape(b, s // block, block)
    real = seg > 0
    lo = jnp.min(jnp.where(real, seg, _BIG), axis=2)
    hi = jnp.max(jnp.where(real, seg, 0), axis=2)
    qi, kj = off_diagonal_pairs(s // block)
    keep = (lo[:, qi] <= hi[:, kj]) & (lo[:, kj] <= hi[:, qi])          # empty blocks: lo > hi, never kept
    size = -(-keep.size // TASK_CHUNK) * TASK_CHUNK     # whole trips: a trip's slice never runs off the end
    flat = jnp.nonzero(keep.reshape(-1), size=size, fill_value=0)[0]
    pair = flat % qi.size
    return ((flat // qi.size).astype(jnp.int32), jnp.asarray(qi, jnp.int32)[pair],
            jnp.asarray(kj, jnp.int32)[pair], jnp.sum(keep, dtype=jnp.int32))


def _blocks(x, block):
    """[B, S, ...] -> [B, S/block, block, ...]."""
    return x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])


def _task_mask(sq, sk, valid, diagonal: bool):
    """[T, bq, bk]: same segment, a valid task, and on diagonal blocks key <= query."""
    ok = (sq[:, :, None] == sk[:, None, :]) & valid[:, None, None]
    if diagonal:
        ok = ok & jnp.tril(jnp.ones(ok.shape[1:], bool))[None]
    return ok


def _scores(q, k, ok):
    """q [T, bq, kv, g, d] (scaled), k [T, bk, kv, d] -> masked float32 scores [T, kv, g, bq, bk]."""
    s = jnp.einsum("tqkgd,tckd->tkgqc", q, k, preferred_element_type=jnp.float32)
    return jnp.where(ok[:, None, None], s, MASK_VALUE)


def _fwd_task(q, k, v, ok):
    """One batch of tasks: their running max m, sum l ([T, bq, kv, g]) and unnormalised output [T, bq, kv, g, d]."""
    s = _scores(q, k, ok)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    o = jnp.einsum("tkgqc,tckd->tqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return jnp.moveaxis(m, 3, 1), jnp.moveaxis(p.sum(-1), 3, 1), o


def _gather(xs, rows, qi, kj):
    """Per task its query-side and key-side blocks of the blocked arrays xs = (q, k, v, seg)."""
    q, k, v, seg = xs
    return q[rows, qi], k[rows, kj], v[rows, kj], seg[rows, qi], seg[rows, kj]


def _trips(count):
    return (count + TASK_CHUNK - 1) // TASK_CHUNK


def _static_tasks(b: int, n: int):
    """Every off-diagonal pair of every row, as one trip's task list (the whole list is one slice)."""
    qi, kj = off_diagonal_pairs(n)
    rows = np.repeat(np.arange(b, dtype=np.int32), qi.size)
    return (jnp.asarray(rows), jnp.asarray(np.tile(qi, b), jnp.int32), jnp.asarray(np.tile(kj, b), jnp.int32),
            jnp.int32(rows.size))


def computes_all_pairs(rows: int, n: int) -> bool:
    """Whether a micro-batch of `rows` rows of n blocks computes every off-diagonal pair in one static trip (no
    block map, no loop): when they fit one trip, skipping some would save nothing."""
    return rows * (n * (n - 1) // 2) <= TASK_CHUNK


def _run_tasks(trip, carry, segment_ids, block):
    """`trip(t, carry, tasks)` over the off-diagonal tasks: all pairs in one static trip where they fit one
    (`computes_all_pairs`), else the block map's kept pairs, `TASK_CHUNK` per trip of a dynamic loop."""
    b, s = segment_ids.shape
    if computes_all_pairs(b, s // block):
        tasks = _static_tasks(b, s // block)
        return trip(0, carry, tasks + (tasks[0].size,))
    tasks = block_map(segment_ids, block)
    return jax.lax.fori_loop(0, _trips(tasks[3]), lambda t, c: trip(t, c, tasks), carry)


def _chunk(tasks, t):
    """Trip t's slice of the task list (rows, qi, kj) and which of its tasks are real."""
    rows, qi, kj, count, *static = tasks
    if static:      # `_static_tasks`: one trip of every pair
        return rows, qi, kj, jnp.ones(static[0], bool)
    lo = t * TASK_CHUNK
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, lo, TASK_CHUNK)
    return take(rows), take(qi), take(kj), lo + jnp.arange(TASK_CHUNK) < count


def fwd_trip(xs, t, state, tasks):
    """One trip of the forward loop: trip t's tasks of `tasks` merged into the running (max, sum, output)."""
    m, l, acc = state
    rows, qi, kj, valid = _chunk(tasks, t)
    tq, tk, tv, sq, sk = _gather(xs, rows, qi, kj)
    tm, tl, to = _fwd_task(tq, tk, tv, _task_mask(sq, sk, valid, diagonal=False))
    new = m.at[rows, qi].max(tm)
    scale = jnp.exp(m - new)
    w = jnp.exp(tm - new[rows, qi])
    l = (l * scale).at[rows, qi].add(tl * w)
    acc = (acc * scale[..., None]).at[rows, qi].add(to * w[..., None])
    return new, l, acc


def bwd_trip(xs, t, grads, tasks):
    """One trip of the backward loop: trip t's tasks' gradients added to (dq, dk, dv); xs = (q, k, v, seg,
    dO, lse, delta) blocked."""
    dq, dk, dv = grads
    dob, lse, delta = xs[4:]
    rows, qi, kj, valid = _chunk(tasks, t)
    tq, tk, tv, sq, sk = _gather(xs[:4], rows, qi, kj)
    g = _bwd_task(tq, tk, tv, _task_mask(sq, sk, valid, diagonal=False), dob[rows, qi], lse[rows, qi],
                  delta[rows, qi])
    return dq.at[rows, qi].add(g[0]), dk.at[rows, kj].add(g[1]), dv.at[rows, kj].add(g[2])


def _forward(q, k, v, segment_ids, block):
    """(output [B,S,kv,g,d] float32, log-sum-exp [B,n,block,kv,g]) with q [B,S,kv,g,d] already scaled."""
    b, s = segment_ids.shape
    n = s // block
    xs = (_blocks(q, block), _blocks(k, block), _blocks(v, block), _blocks(segment_ids, block))
    flat = lambda x: x.reshape(b * n, *x.shape[2:])
    ok = _task_mask(flat(xs[3]), flat(xs[3]), jnp.ones(b * n, bool), diagonal=True)
    m, l, acc = _fwd_task(flat(xs[0]), flat(xs[1]), flat(xs[2]), ok)
    state = tuple(x.reshape(b, n, *x.shape[1:]) for x in (m, l, acc))
    if n > 1:
        state = _run_tasks(functools.partial(fwd_trip, xs), state, segment_ids, block)
    m, l, acc = state
    out = (acc / l[..., None]).reshape(b, s, *acc.shape[3:])
    return out, m + jnp.log(l)


def _bwd_task(q, k, v, ok, do, lse, delta):
    """Gradients (dq, dk, dv) of a batch of tasks from the saved log-sum-exp and delta = Σ dO·O per query."""
    s = _scores(q, k, ok)
    p = jnp.where(ok[:, None, None], jnp.exp(s - jnp.moveaxis(lse, 1, 3)[..., None]), 0.0)
    dv = jnp.einsum("tkgqc,tqkgd->tckd", p, do)
    dp = jnp.einsum("tqkgd,tckd->tkgqc", do, v.astype(jnp.float32))
    ds = p * (dp - jnp.moveaxis(delta, 1, 3)[..., None])
    dq = jnp.einsum("tkgqc,tckd->tqkgd", ds, k.astype(jnp.float32))
    dk = jnp.einsum("tkgqc,tqkgd->tckd", ds, q.astype(jnp.float32))
    return dq, dk, dv


def _backward(q, k, v, segment_ids, out, lse, do, block):
    """dq, dk, dv (float32, blocked [B,n,block,...]) of `_forward`'s output for the cotangent `do`."""
    b, s = segment_ids.shape
    n = s // block
    xs = (_blocks(q, block), _blocks(k, block), _blocks(v, block), _blocks(segment_ids, block))
    dob = _blocks(do.astype(jnp.float32), block)
    delta = jnp.sum(dob * _blocks(out, block), axis=-1)
    flat = lambda x: x.reshape(b * n, *x.shape[2:])
    ok = _task_mask(flat(xs[3]), flat(xs[3]), jnp.ones(b * n, bool), diagonal=True)
    grads = _bwd_task(flat(xs[0]), flat(xs[1]), flat(xs[2]), ok, flat(dob), flat(lse), flat(delta))
    grads = tuple(g.reshape(b, n, *g.shape[1:]) for g in grads)
    if n > 1:
        grads = _run_tasks(functools.partial(bwd_trip, xs + (dob, lse, delta)), grads, segment_ids, block)
    return grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segment_ids, block):
    return _forward(q, k, v, segment_ids, block)[0].astype(q.dtype)


def _attention_fwd(q, k, v, segment_ids, block):
    out, lse = _forward(q, k, v, segment_ids, block)
    return out.astype(q.dtype), (q, k, v, segment_ids, out, lse)


def _attention_bwd(block, res, do):
    q, k, v, segment_ids, out, lse = res
    dq, dk, dv = _backward(q, k, v, segment_ids, out, lse, do, block)
    shape = lambda g, x: g.reshape(x.shape).astype(x.dtype)
    return shape(dq, q), shape(dk, k), shape(dv, v), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def packed_causal_attention(q, k, v, segment_ids, block: int):
    """Causal attention of packed rows: q [B,S,H,D], k/v [B,S,Hkv,D] (H % Hkv == 0), segment ids int32[B,S]
    (0 = padding); `block` divides S. Equal to the dense masked attention for every query of a nonzero
    segment (up to summation order); a padding query attends to the padding of its own block."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    qs = q.reshape(b, s, hkv, h // hkv, d) * jnp.asarray(d ** -0.5, q.dtype)
    return _attention(qs, k, v, jnp.asarray(segment_ids, jnp.int32), block).reshape(b, s, h, d)


# ----------------------------------------------------------------------------- the same tasks, counted on the host
def _row_map(lengths, block: int) -> tuple[int, int, int]:
    """(off-diagonal pairs the block map keeps, real slots, kept pairs whose query block is the one the first
    padded slot falls in) of one row holding sequences of `lengths` from position 0: a pair is kept where one
    sequence spans both blocks; two sequences never span the same pair (they share at most a diagonal block)."""
    kept, at = 0, 0
    for s in lengths:
        if int(s) > 0:
            first, last = at // block, (at + int(s) - 1) // block
            kept += (last - first) * (last - first + 1) // 2
        at += int(s)
    edge = at // block * block           # the first slot of the block the first padded slot falls in
    into = 0
    if edge < at:
        start = 0
        for s in lengths:                # the sequence holding slot `edge`: its blocks before edge's
            if start + int(s) > edge:
                into = edge // block - start // block
                break
            start += int(s)
    return kept, at, into


def _pad_entries(fill: int, width: int, block: int, all_pairs: bool, into: int) -> int:
    """Score entries of a row's padded queries (slots fill..width-1): `block` keys per task of their block --
    every key block up to theirs where the micro-batch computes all pairs, else the diagonal and, for the block
    the first padded slot falls in, the `into` pairs kept for the sequence reaching into it."""
    if fill >= width:
        return 0
    n, edge = width // block, fill // block
    if all_pairs:
        return (block - fill % block) * block * (edge + 1) + block * block * sum(range(edge + 2, n + 1))
    return (block - fill % block) * block * (1 + into) + block * block * (n - edge - 1)


def kernel_entries(rows, num_rows: int, width: int, block: int) -> tuple[int, int]:
    """(score entries per head and layer that `packed_causal_attention` computes on a micro-batch of `num_rows`
    rows of `width` in blocks of `block`, of which those of padded queries and of a trip's unused tasks), for
    rows holding the sequences of the length lists `rows` (laid out in order from each row's start; rows beyond
    them are padding)."""
    n = width // block
    all_pairs = computes_all_pairs(num_rows, n)
    kept = pad = 0
    for lens in list(rows) + [()] * (num_rows - len(rows)):
        k, fill, into = _row_map(lens, block)
        kept += k
        pad += _pad_entries(fill, width, block, all_pairs, into)
    if all_pairs:
        return num_rows * n * (n + 1) // 2 * block * block, pad
    slots = -(-kept // TASK_CHUNK) * TASK_CHUNK
    return (num_rows * n + slots) * block * block, pad + (slots - kept) * block * block
