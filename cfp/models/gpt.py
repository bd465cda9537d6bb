"""GPT-2 style decoder: pre-LN, learned positions, GELU MLP, causal attention.

Split into ``Embed`` / ``Layer`` / ``Head`` so a pipeline runtime can run stages
piecewise with sub-trees of the full ``Model`` params.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from cfp.models.configs import GPTConfig
from cfp.models.layers import (MLP, Attention, compose, compute_dtype, dense, layer_norm,
                               token_and_position, zero_aux)


class Embed(nn.Module):
    """int32 tokens [B,S] -> hidden [B,S,H]: token + learned position embedding."""
    config: GPTConfig

    @nn.compact
    def __call__(self, tokens, positions=None):
        return token_and_position(self, self.config, tokens, positions)


class Layer(nn.Module):
    """One pre-LN transformer block; returns ``(x, aux)`` with aux = 0.0."""
    config: GPTConfig
    layer_idx: int = 0

    def ffn(self, x):
        """Feed-forward sub-block; MoE overrides it.  Returns (y, aux)."""
        return MLP(self.config.ffn_size, compute_dtype(self.config), name="mlp")(x), zero_aux()

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        cfg = self.config
        dt = compute_dtype(cfg)
        x = x.astype(dt)
        h = layer_norm(dt, name="ln_attn")(x)
        x = x + Attention(cfg.num_heads, cfg.num_heads, cfg.head_dim, causal=True, dtype=dt,
                          name="attn")(h, segment_ids, positions)
        h = layer_norm(dt, name="ln_mlp")(x)
        y, aux = self.ffn(h)
        return x + y, aux


class Head(nn.Module):
    """hidden [B,S,H] -> float32 logits [B,S,V]: final LayerNorm + untied LM head."""
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        dt = compute_dtype(self.config)
        x = layer_norm(dt, name="ln_f")(x.astype(dt))
        logits = dense(self.config.vocab_size, dt, use_bias=False, name="lm_head")(x)
        return logits.astype(jnp.float32)


class Model(nn.Module):
    """Full GPT: ``tokens -> (logits, aux_total)``."""
    config: GPTConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None):
        return compose(self.config, Embed, Layer, Head, tokens, segment_ids, positions)
