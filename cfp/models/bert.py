"""BERT encoder: post-LN, bidirectional attention, learned positions, MLM head.

No padding mask: every position is a real token (batches come from ``make_batch``).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from cfp.models.configs import BertConfig
from cfp.models.layers import (MLP, Attention, compose, compute_dtype, dense, layer_norm,
                               token_and_position, zero_aux)

LN_EPS = 1e-12  # BERT's LayerNorm epsilon


class Embed(nn.Module):
    """int32 tokens [B,S] -> hidden [B,S,H]: token + position embedding, then LayerNorm."""
    config: BertConfig

    @nn.compact
    def __call__(self, tokens):
        x = token_and_position(self, self.config, tokens)
        return layer_norm(compute_dtype(self.config), "ln", LN_EPS)(x)


class Layer(nn.Module):
    """One post-LN encoder block; returns ``(x, 0.0)``."""
    config: BertConfig
    layer_idx: int = 0

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dt = compute_dtype(cfg)
        x = x.astype(dt)
        attn = Attention(cfg.num_heads, cfg.num_heads, cfg.head_dim, causal=False, dtype=dt,
                         name="attn")(x)
        x = layer_norm(dt, "ln_attn", LN_EPS)(x + attn)
        x = layer_norm(dt, "ln_mlp", LN_EPS)(x + MLP(cfg.ffn_size, dt, name="mlp")(x))
        return x, zero_aux()


class Head(nn.Module):
    """MLM head: dense + GELU + LayerNorm, then an untied vocab projection (float32 logits)."""
    config: BertConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dt = compute_dtype(cfg)
        h = nn.gelu(dense(cfg.hidden_size, dt, name="transform")(x.astype(dt)))
        h = layer_norm(dt, "ln", LN_EPS)(h)
        return dense(cfg.vocab_size, dt, name="decoder")(h).astype(jnp.float32)


class Model(nn.Module):
    """Full BERT: ``tokens -> (MLM logits, 0.0)``."""
    config: BertConfig

    @nn.compact
    def __call__(self, tokens):
        return compose(self.config, Embed, Layer, Head, tokens)
