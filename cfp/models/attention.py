"""The model zoo's attention: plain dot-product attention, or context parallelism (CP) when a
`context_parallel` scope is active.

CP shards the sequence dim of q/k/v over a mesh axis. Each device keeps its query chunk; keys/values are either
all-gathered (GATHER: simple, memory O(S) per device) or passed around a ring with an online softmax (RING:
memory O(S/cp), one neighbour exchange per step, as in Ring Attention). Causality and packing use explicit
positions and segment ids, since a chunk's row index is no longer its position in the sequence.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from cfp.errors import ConfigError
from cfp.models.packed_attention import MASK_VALUE, packed_causal_attention


MIN_BLOCK = 32      # query/key block of packed causal attention: rows of >= 2 blocks run blocked


def attention_block(seq_len: int) -> int:
    """Block length of `packed_causal_attention` for rows of `seq_len` (the row itself: dense attention)."""
    return MIN_BLOCK if seq_len % MIN_BLOCK == 0 and seq_len >= 2 * MIN_BLOCK else seq_len


def causal_pairs(seq_len: int) -> int:
    """(query, key) score entries per row and head of every block on or below the diagonal (blocks on the
    diagonal whole): what packed attention computes for a row that one sequence fills, or the whole square."""
    block = attention_block(seq_len)
    n = seq_len // block
    return block * block * n * (n + 1) // 2


def dot_product_attention(q, k, v, causal: bool, segment_ids=None):
    """q [B,S,H,D], k/v [B,T,Hkv,D] with H % Hkv == 0 (grouped-query when Hkv < H).

    `segment_ids` int32[B,S] (packed sequences, S == T): a query attends only to keys of its own segment,
    so attention never crosses sequences. Returns [B,S,H,D] in q's dtype. The XLA path
    `cfp.models.attention_select` chooses on devices without fused kernels: causal attention over packed rows
    runs `packed_causal_attention` (only the blocks of each row that some sequence spans are computed);
    without segment ids the whole score matrix is computed (`dense_attention`), as the CFP analysis of the
    plain models expects.
    """
    # imported here: attention_select builds on this module (the choice lives there, in one place)
    from cfp.models import attention_select as sel
    return sel.attend(sel.choose(sel.XLA_DEVICE, sel.case_of(q, v, causal, segment_ids)), q, k, v, causal,
                      segment_ids)


def dense_attention(q, k, v, causal: bool, segment_ids=None):
    """`dot_product_attention` over the whole score matrix: float32 scores of every (query, key) pair, masked."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    # Query head h uses kv head h // (H // Hkv): group consecutive query heads.
    q = q.reshape(b, s, hkv, h // hkv, d) * jnp.asarray(d ** -0.5, q.dtype)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32)
    if causal:
        mask = jnp.tril(jnp.ones((s, k.shape[1]), dtype=bool))
        scores = jnp.where(mask, scores, MASK_VALUE)
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B,S,T]
        scores = jnp.where(same[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


class CpMethod(enum.Enum):
    GATHER = "gather"
    RING = "ring"


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Shard the sequence dim over mesh axis `axis`; heads over `head_axis` (tensor parallelism) if given."""
    mesh: Mesh
    axis: str
    method: CpMethod = CpMethod.RING
    head_axis: Optional[str] = None

    def __post_init__(self):
        for a in (self.axis, self.head_axis):
            if a is not None and a not in self.mesh.axis_names:
                raise ConfigError(f"mesh axis {a!r} is not in the mesh's axes {self.mesh.axis_names}")

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]


_ACTIVE: contextvars.ContextVar[Optional[ContextParallel]] = contextvars.ContextVar("cfp_cp", default=None)


@contextlib.contextmanager
def context_parallel(cp: ContextParallel):
    """Within this scope (at trace time) causal attention runs context-parallel under `cp`."""
    token = _ACTIVE.set(cp)
    try:
        yield cp
    finally:
        _ACTIVE.reset(token)


def attend(q, k, v, causal: bool, segment_ids=None, positions=None):
    """Attention of the model zoo: context-parallel under a `context_parallel` scope, else the implementation
    `cfp.models.attention_select` chooses for the devices it is traced for (fused on GPUs that support it)."""
    cp = _ACTIVE.get()
    if cp is None:
        from cfp.models.attention_select import zoo_attend     # here: attention_select imports this module
        return zoo_attend(q, k, v, causal, segment_ids)
    return cp_attention(q, k, v, cp, causal, segment_ids, positions)


def _masked_scores(q, k, q_seg, k_seg, q_pos, k_pos, causal):
    """q [b,s,kv,g,d] (already scaled), k [b,t,kv,d] -> float32 scores [b,kv,g,s,t] with the mask applied."""
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32)
    ok = q_seg[:, :, None] == k_seg[:, None, :]
    if causal:
        ok = ok & (k_pos[:, None, :] <= q_pos[:, :, None])
    return jnp.where(ok[:, None, None], scores, MASK_VALUE)


def _gather_local(q, k, v, q_seg, q_pos, axis, causal):
    k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    k_seg = jax.lax.all_gather(q_seg, axis, axis=1, tiled=True)
    k_pos = jax.lax.all_gather(q_pos, axis, axis=1, tiled=True)
    probs = jax.nn.softmax(_masked_scores(q, k_all, q_seg, k_seg, q_pos, k_pos, causal), axis=-1)
    return jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), v_all)


def _ring_local(q, k, v, q_seg, q_pos, axis, causal, n):
    perm = [(i, (i + 1) % n) for i in range(n)]
    b, s, hkv, g, _ = q.shape
    m0 = jnp.full((b, hkv, g, s), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((b, hkv, g, s), jnp.float32)
    acc0 = jnp.zeros(q.shape, jnp.float32)

    def body(_, carry):
        kk, vv, ks, kp, m, l, acc = carry
        sc = _masked_scores(q, kk, q_seg, ks, q_pos, kp, causal)
        m_new = jnp.maximum(m, sc.max(-1))
        p = jnp.exp(sc - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        pv = jnp.einsum("bkgst,btkd->bskgd", p, vv.astype(jnp.float32))
        acc = acc * jnp.moveaxis(corr, 3, 1)[..., None] + pv
        kk, vv, ks, kp = (jax.lax.ppermute(x, axis, perm) for x in (kk, vv, ks, kp))
        return kk, vv, ks, kp, m_new, l, acc

    *_, l, acc = jax.lax.fori_loop(0, n, body, (k, v, q_seg, q_pos, m0, l0, acc0))
    return (acc / jnp.moveaxis(l, 3, 1)[..., None]).astype(q.dtype)


def cp_attention(q, k, v, cp: ContextParallel, causal: bool = True, segment_ids=None, positions=None):
    """Attention with q [B,S,H,D], k/v [B,S,Hkv,D] sharded over `cp.axis` on S; equals unsharded attention."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    if s % cp.size:
        raise ConfigError(f"sequence length {s} is not divisible by the context-parallel degree {cp.size}")
    if segment_ids is None:
        segment_ids = jnp.zeros((b, s), jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    qs = P(None, cp.axis, cp.head_axis, None)
    ts = P(None, cp.axis)

    def local(q, k, v, seg, pos):
        lq = q.reshape(q.shape[0], q.shape[1], k.shape[2], -1, d) * jnp.asarray(d ** -0.5, q.dtype)
        if cp.method is CpMethod.GATHER:
            out = _gather_local(lq, k, v, seg, pos, cp.axis, causal)
        else:
            out = _ring_local(lq, k, v, seg, pos, cp.axis, causal, cp.size)
        return out.reshape(q.shape)

    del h, hkv
    return jax.shard_map(local, mesh=cp.mesh, in_specs=(qs, qs, qs, ts, ts), out_specs=qs,
                         check_vma=False)(q, k, v, segment_ids, positions)
