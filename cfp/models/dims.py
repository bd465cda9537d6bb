"""Logical dim names of the zoo's parameters: what each tensor dim of a weight *means*.

A parameter is found by the module that owns it and its own name (the last two keys of its pytree path);
its dims are named from the shared vocabulary below. Mesh axes are assigned to these names in one place,
`cfp.sharding.rules`, which the baselines, the runtime and the planner share (the MaxText
`logical_axis_rules` idea). A parameter not listed, or listed for another rank, has no named dims and stays
replicated under every rule.

Vocabulary: "embed" (hidden size), "heads" / "kv_heads" (attention heads), "head_dim", "mlp" (feed-forward
size), "vocab", "exp" (MoE experts); None is a dim no rule may shard.
"""
from __future__ import annotations

from typing import Optional, Sequence

Dims = tuple[Optional[str], ...]

# the config field behind each name, for error messages
DIM_FIELDS = {"heads": "num_heads", "kv_heads": "num_kv_heads", "mlp": "ffn_size", "vocab": "vocab_size",
              "exp": "num_experts", "embed": "hidden_size"}

# (owning module, parameter) -> dims; models/layers.py's Attention and MLP, llama.py's SwiGLU, moe.py's MoEFFN,
# the GPT/Llama embedding and LM head (BERT's tied-free head `transform`/`decoder` is left replicated)
PARAM_DIMS: dict[tuple[str, str], Dims] = {
    # Attention: q/k/v kernels [H, heads, D], biases [heads, D]; out [heads, D, H]
    ("query", "kernel"): ("embed", "heads", "head_dim"),
    ("query", "bias"): ("heads", "head_dim"),
    ("key", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("key", "bias"): ("kv_heads", "head_dim"),
    ("value", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("value", "bias"): ("kv_heads", "head_dim"),
    ("out", "kernel"): ("heads", "head_dim", "embed"),
    # MLP (GPT, BERT) and SwiGLU (Llama): [H, F] in, [F, H] out
    ("fc_in", "kernel"): ("embed", "mlp"),
    ("fc_in", "bias"): ("mlp",),
    ("fc_out", "kernel"): ("mlp", "embed"),
    ("gate", "kernel"): ("embed", "mlp"),
    ("up", "kernel"): ("embed", "mlp"),
    ("down", "kernel"): ("mlp", "embed"),
    # MoE experts [E, H, F] and [E, F, H]; the router [H, E] is small and stays replicated
    ("moe", "wi"): ("exp", "embed", "mlp"),
    ("moe", "wo"): ("exp", "mlp", "embed"),
    ("moe", "gate"): ("embed", None),
    # token embedding [V, H] and LM head [H, V]
    ("token", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
}


def param_dims(keys: Sequence[str], rank: int) -> Dims:
    """Dim names of the parameter at pytree keys `keys` (..., module, name) with `rank` dims; all None when
    the table does not know it."""
    dims = PARAM_DIMS.get((keys[-2], keys[-1])) if len(keys) >= 2 else None
    return dims if dims is not None and len(dims) == rank else (None,) * rank
