"""Building blocks shared by the model zoo.

Attention is written with explicit einsums (no fused kernels) so the analysis pass
sees every dot_general.  Parameters are float32; activations use the config's
compute dtype; softmax runs in float32 for stability.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax.numpy as jnp

from cfp.errors import ConfigError

PARAM_DTYPE = jnp.float32
# GPT-2 style small init keeps initial logits near zero, so the loss starts at log(V).
INIT = nn.initializers.normal(stddev=0.02)
MASK_VALUE = -1e9  # finite so fully-masked rows never produce NaN


def compute_dtype(config: Any) -> jnp.dtype:
    return jnp.dtype(config.dtype)


def dense(features, dtype, use_bias=True, axis=-1, name=None) -> nn.DenseGeneral:
    """DenseGeneral with float32 params and the given compute dtype (2-D or 3-D kernel)."""
    return nn.DenseGeneral(features, axis=axis, use_bias=use_bias, dtype=dtype,
                           param_dtype=PARAM_DTYPE, kernel_init=INIT, name=name)


def check_seq_len(tokens_or_x: Any, config: Any) -> int:
    s = tokens_or_x.shape[1]
    if s > config.seq_len:
        raise ConfigError(f"sequence length {s} exceeds config seq_len={config.seq_len}")
    return s


def token_and_position(module: nn.Module, config: Any, tokens: Any) -> Any:
    """Token plus learned position embedding, created in `module`'s scope (params `token`, `position`);
    call it from the compact `__call__` of a model's `Embed`."""
    dt = compute_dtype(config)
    s = check_seq_len(tokens, config)
    tok = nn.Embed(config.vocab_size, config.hidden_size, dtype=dt, param_dtype=PARAM_DTYPE,
                   embedding_init=INIT, name="token")(tokens)
    pos = module.param("position", INIT, (config.seq_len, config.hidden_size), PARAM_DTYPE)
    return tok + pos[:s].astype(dt)


def dot_product_attention(q, k, v, causal: bool):
    """q [B,S,H,D], k/v [B,T,Hkv,D] with H % Hkv == 0 (grouped-query when Hkv < H).

    Returns [B,S,H,D] in q's dtype.
    """
    b, s, h, d = q.shape
    hkv = k.shape[2]
    # Query head h uses kv head h // (H // Hkv): group consecutive query heads.
    q = q.reshape(b, s, hkv, h // hkv, d) * jnp.asarray(d ** -0.5, q.dtype)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32)
    if causal:
        mask = jnp.tril(jnp.ones((s, k.shape[1]), dtype=bool))
        scores = jnp.where(mask, scores, MASK_VALUE)
    probs = nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention with separate q/k/v projections.

    ``rope`` is an optional function applied to q and k ([B,S,H,D] -> same).
    """
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    dtype: Any
    use_bias: bool = True
    rope: Optional[Callable] = None

    @nn.compact
    def __call__(self, x):
        hidden = x.shape[-1]
        q = dense((self.num_heads, self.head_dim), self.dtype, self.use_bias, name="query")(x)
        k = dense((self.num_kv_heads, self.head_dim), self.dtype, self.use_bias, name="key")(x)
        v = dense((self.num_kv_heads, self.head_dim), self.dtype, self.use_bias, name="value")(x)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        out = dot_product_attention(q, k, v, self.causal)
        return dense(hidden, self.dtype, self.use_bias, axis=(-2, -1), name="out")(out)


class MLP(nn.Module):
    """Two-layer GELU feed-forward block (GPT/BERT)."""
    ffn_size: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(dense(self.ffn_size, self.dtype, name="fc_in")(x))
        return dense(x.shape[-1], self.dtype, name="fc_out")(h)


def layer_norm(dtype, name=None, epsilon=1e-5) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=epsilon, dtype=dtype, param_dtype=PARAM_DTYPE, name=name)


def zero_aux():
    return jnp.zeros((), jnp.float32)


def compose(parent_config, embed_cls, layer_cls, head_cls, tokens):
    """Body of every ``Model.__call__``: embed -> layers_0..L-1 -> head.

    Must be called inside a compact method so submodules get the fixed names
    ``embed``, ``layers_{i}``, ``head`` the pipeline runtime relies on.
    """
    x = embed_cls(parent_config, name="embed")(tokens)
    aux = zero_aux()
    for i in range(parent_config.num_layers):
        x, a = layer_cls(parent_config, i, name=f"layers_{i}")(x)
        aux = aux + a
    return head_cls(parent_config, name="head")(x), aux
