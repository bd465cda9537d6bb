"""GShard mixture-of-experts decoder: GPT layers where every odd layer's MLP is top-2 MoE.

Tokens are flattened and cut into groups of ``expert_group_size``; routing, dispatch
and combine are "GSEC" einsums (dispatch mask [G,S,E,C]; expert weights [E,H,F] and
[E,F,H]) so the sharding planner sees ordinary dot_generals.  Routing is deterministic
(no gate noise).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from cfp.errors import ConfigError
from cfp.models import gpt
from cfp.models.configs import MoEConfig
from cfp.models.layers import INIT, PARAM_DTYPE, compose, compute_dtype

Embed = gpt.Embed
Head = gpt.Head


def top2_gating(logits, capacity: int):
    """GShard top-2 routing for gate logits [G,S,E] (float32).

    Returns ``(dispatch, combine, aux)``: dispatch [G,S,E,C] is 0/1 (token s occupies
    slot c of expert e), combine [G,S,E,C] is dispatch times the token's normalised
    top-2 gate weight, aux is the load-balancing loss
    ``E * sum_e(fraction of tokens whose top-1 is e * mean gate prob of e)`` (1 when
    balanced), averaged over groups.

    Slots are claimed in token order, a token's two choices together.  Mesh-TF instead
    seats every first choice before any second choice, which lets a *later* token evict
    an earlier token's second choice; claiming in order keeps a causal model causal.
    Tokens arriving after an expert is full are dropped for that expert.
    """
    num_experts = logits.shape[-1]
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    mask1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), num_experts, dtype=jnp.int32)
    rest = jnp.where(mask1 > 0, -1.0, gates)  # exclude the first choice
    mask2 = jax.nn.one_hot(jnp.argmax(rest, axis=-1), num_experts, dtype=jnp.int32)

    fraction = jnp.mean(mask1.astype(jnp.float32), axis=1)  # [G,E]
    mean_prob = jnp.mean(gates, axis=1)  # [G,E]
    aux = jnp.mean(jnp.sum(fraction * mean_prob, axis=-1)) * num_experts

    chosen = mask1 + mask2  # [G,S,E], two ones per token
    position = jnp.cumsum(chosen, axis=1) - 1  # slot each (token, expert) would take
    keep = chosen * (position < capacity)
    dispatch = jax.nn.one_hot(position, capacity, dtype=jnp.float32) * keep[..., None]
    # Normalise the two chosen gates to sum to 1 before drops (as GShard does).
    top2 = jnp.sum(gates * chosen, axis=-1, keepdims=True)
    weight = gates * keep / jnp.maximum(top2, 1e-9)
    combine = weight[..., None] * dispatch
    return dispatch, combine, aux


class MoEFFN(nn.Module):
    """Top-2 mixture-of-experts FFN: [B,S,H] -> ([B,S,H], aux)."""
    config: MoEConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dt = compute_dtype(cfg)
        b, s, h = x.shape
        n, gsz, e, f = b * s, cfg.expert_group_size, cfg.num_experts, cfg.ffn_size
        if n % gsz:
            raise ConfigError(
                f"MoE needs batch*seq_len divisible by expert_group_size: "
                f"{b}*{s}={n} tokens, expert_group_size={gsz}")
        xg = x.astype(dt).reshape(n // gsz, gsz, h)
        w_gate = self.param("gate", INIT, (h, e), PARAM_DTYPE)
        w_in = self.param("wi", INIT, (e, h, f), PARAM_DTYPE)
        w_out = self.param("wo", INIT, (e, f, h), PARAM_DTYPE)
        # Routing in float32: bf16 rounding would flip argmax ties and slot decisions.
        logits = jnp.einsum("gsm,me->gse", xg.astype(jnp.float32), w_gate)
        dispatch, combine, aux = top2_gating(logits, cfg.expert_capacity)
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(dt), xg)
        hidden = nn.gelu(jnp.einsum("egcm,emf->egcf", expert_in, w_in.astype(dt)))
        expert_out = jnp.einsum("egcf,efm->egcm", hidden, w_out.astype(dt))
        y = jnp.einsum("gsec,egcm->gsm", combine.astype(dt), expert_out)
        return y.reshape(b, s, h), aux


class Layer(gpt.Layer):
    """GPT block; odd ``layer_idx`` uses the MoE FFN and returns its aux loss."""
    config: MoEConfig
    layer_idx: int = 0

    def ffn(self, x):
        if self.layer_idx % 2 == 1:
            return MoEFFN(self.config, name="moe")(x)
        return super().ffn(x)


class Model(nn.Module):
    """Full MoE model: ``tokens -> (logits, sum of MoE aux losses)``."""
    config: MoEConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None):
        return compose(self.config, Embed, Layer, Head, tokens, segment_ids, positions)
