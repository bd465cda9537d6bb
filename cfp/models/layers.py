"""Building blocks shared by the model zoo.

Attention (`cfp.models.attention.attend`) runs what `cfp.models.attention_select` chooses for the devices it
is traced for: on CPUs explicit einsums (so the analysis pass sees every dot_general), on GPUs that support it
cuDNN's fused kernel.  Parameters are float32; activations use the config's
compute dtype; softmax runs in float32 for stability.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax.numpy as jnp

from cfp.errors import ConfigError
from cfp.models.attention import attend

PARAM_DTYPE = jnp.float32
# GPT-2 style small init keeps initial logits near zero, so the loss starts at log(V).
INIT = nn.initializers.normal(stddev=0.02)


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


def token_and_position(module: nn.Module, config: Any, tokens: Any, positions: Any = None) -> Any:
    """Token plus learned position embedding, created in `module`'s scope (params `token`, `position`);
    call it from the compact `__call__` of a model's `Embed`. `positions` int32[B,S] (packed sequences,
    restarting at 0 per sequence) replaces the default 0..S-1."""
    dt = compute_dtype(config)
    s = check_seq_len(tokens, config)
    tok = nn.Embed(config.vocab_size, config.hidden_size, dtype=dt, param_dtype=PARAM_DTYPE,
                   embedding_init=INIT, name="token")(tokens)
    pos = module.param("position", INIT, (config.seq_len, config.hidden_size), PARAM_DTYPE)
    if positions is not None:
        return tok + jnp.take(pos, positions, axis=0).astype(dt)
    return tok + pos[:s].astype(dt)


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention with separate q/k/v projections.

    ``rope`` is an optional function applied to q and k (``rope(x, positions)``, [B,S,H,D] -> same).
    ``segment_ids``/``positions`` [B,S] describe packed sequences (None: one sequence per row). Under
    ``cfp.models.attention.context_parallel`` the sequence dim is sharded and keys/values are gathered or
    ring-passed over the context-parallel mesh axis.
    """
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    dtype: Any
    use_bias: bool = True
    rope: Optional[Callable] = None

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        hidden = x.shape[-1]
        q = dense((self.num_heads, self.head_dim), self.dtype, self.use_bias, name="query")(x)
        k = dense((self.num_kv_heads, self.head_dim), self.dtype, self.use_bias, name="key")(x)
        v = dense((self.num_kv_heads, self.head_dim), self.dtype, self.use_bias, name="value")(x)
        if self.rope is not None:
            q, k = self.rope(q, positions=positions), self.rope(k, positions=positions)
        out = attend(q, k, v, self.causal, segment_ids, positions)
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


def packing_kwargs(segment_ids=None, positions=None) -> dict:
    """Keyword arguments describing packed sequences; empty when the batch is one sequence per row, so
    models without packing support (BERT) keep their plain call."""
    if (segment_ids is None) != (positions is None):
        raise ConfigError("packed sequences need both segment_ids and positions (or neither)")
    return {} if segment_ids is None else {"segment_ids": segment_ids, "positions": positions}


def compose(parent_config, embed_cls, layer_cls, head_cls, tokens, segment_ids=None, positions=None):
    """Body of every ``Model.__call__``: embed -> layers_0..L-1 -> head.

    Must be called inside a compact method so submodules get the fixed names
    ``embed``, ``layers_{i}``, ``head`` the pipeline runtime relies on. ``segment_ids``/``positions``
    int32[B,S] run packed sequences (causal models only).
    """
    kw = packing_kwargs(segment_ids, positions)
    x = embed_cls(parent_config, name="embed")(tokens, **({"positions": positions} if kw else {}))
    aux = zero_aux()
    for i in range(parent_config.num_layers):
        x, a = layer_cls(parent_config, i, name=f"layers_{i}")(x, **kw)
        aux = aux + a
    return head_cls(parent_config, name="head")(x), aux
