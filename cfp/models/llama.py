"""Llama-2 decoder: RMSNorm, RoPE on q/k, SwiGLU MLP, grouped-query attention, no biases."""
from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from cfp.models.configs import LlamaConfig
from cfp.models.layers import (INIT, PARAM_DTYPE, Attention, check_seq_len, compose,
                               compute_dtype, dense, zero_aux)


def apply_rope(x, theta: float = 10000.0, positions: Optional[jnp.ndarray] = None):
    """Rotary embedding on x [B,S,H,D] (rotate-half layout, as in HF Llama).

    ``positions`` is [S] or [B,S] (packed sequences restart at 0); default 0..S-1.
    Angles are computed in float32 (bf16 positions would collide for long sequences).
    """
    s, d = x.shape[1], x.shape[-1]
    if positions is None:
        positions = jnp.arange(s, dtype=jnp.float32)
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [D/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [S, D/2] or [B, S, D/2]
    ang = ang[None] if ang.ndim == 2 else ang
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(cfg: LlamaConfig, name: str) -> nn.RMSNorm:
    return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=compute_dtype(cfg), param_dtype=PARAM_DTYPE,
                      name=name)


class Embed(nn.Module):
    """int32 tokens [B,S] -> hidden [B,S,H] (positions come from RoPE inside layers)."""
    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens, positions=None):  # positions unused: RoPE takes them in the layers
        cfg = self.config
        check_seq_len(tokens, cfg)
        return nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=compute_dtype(cfg),
                        param_dtype=PARAM_DTYPE, embedding_init=INIT, name="token")(tokens)


class SwiGLU(nn.Module):
    ffn_size: int
    dtype: object

    @nn.compact
    def __call__(self, x):
        gate = dense(self.ffn_size, self.dtype, use_bias=False, name="gate")(x)
        up = dense(self.ffn_size, self.dtype, use_bias=False, name="up")(x)
        return dense(x.shape[-1], self.dtype, use_bias=False, name="down")(nn.silu(gate) * up)


class Layer(nn.Module):
    """One Llama block (pre-RMSNorm attention + SwiGLU); returns ``(x, 0.0)``."""
    config: LlamaConfig
    layer_idx: int = 0

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        cfg = self.config
        dt = compute_dtype(cfg)
        x = x.astype(dt)
        check_seq_len(x, cfg)
        rope = functools.partial(apply_rope, theta=cfg.rope_theta)
        x = x + Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, causal=True, dtype=dt,
                          use_bias=False, rope=rope, name="attn")(rms_norm(cfg, "attn_norm")(x),
                                                                   segment_ids, positions)
        x = x + SwiGLU(cfg.ffn_size, dt, name="mlp")(rms_norm(cfg, "mlp_norm")(x))
        return x, zero_aux()


class Head(nn.Module):
    """hidden -> float32 logits: final RMSNorm + untied LM head."""
    config: LlamaConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dt = compute_dtype(cfg)
        x = rms_norm(cfg, "norm")(x.astype(dt))
        return dense(cfg.vocab_size, dt, use_bias=False, name="lm_head")(x).astype(jnp.float32)


class Model(nn.Module):
    """Full Llama-2: ``tokens -> (logits, aux_total)`` (aux is always 0)."""
    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None):
        return compose(self.config, Embed, Layer, Head, tokens, segment_ids, positions)
