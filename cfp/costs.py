"""Each model of the zoo described once for pricing: per-device parameters, dot FLOPs with their GEMM shapes,
memory-bound bytes and kept activations of a layer, the embedding and the head, at a tensor-parallel degree.

Parameters come from the model's own parameter tree (`jax.eval_shape` of `init_params`: nothing is allocated)
under the tensor-parallel rules of `cfp.sharding.rules`, which read the logical dim names of `cfp.models.dims`
(a parameter is split where a rule's dim divides the TP degree and replicated otherwise, as the runtime runs it).
The projections' GEMMs come from the same tree: every kernel is one GEMM of the tokens by its per-device
shape (MoE experts: of their capacity slots), its input dims those before the "embed" dim's output, or
"embed" itself. What no parameter shows is written per family below: the attention einsums, MoE routing
(dispatch and combine einsums), and the memory-bound work (softmax, norms, residuals, activations, RoPE, the
MoE masks, the loss) as bytes read and written, priced at memory bandwidth rather than at the GEMM rate.

A MoE model alternates dense and expert layers (odd layers are MoE); a layer's figure is the mean of the two
kinds, exact for stages of an even number of layers.

Used by the planner (`cfp.planner.costmodel`), the data pass's estimated scheme space
(`cfp.data.scheme_space`) and the stage search's boundary pricing (`cfp.runtime.stage.plan_search`).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from cfp.errors import ConfigError
from cfp.models.configs import MODEL_FAMILIES, BertConfig, LlamaConfig, MoEConfig
from cfp.models.dims import param_dims
from cfp.models.zoo import build_model
from cfp.sharding.rules import path_keys, tensor_dim

Gemm = tuple[float, tuple[float, float, float]]     # (FLOPs, per-device GEMM shape (m, n, k))
_MISSING = object()
PARAM_BYTES = 4           # the runtime keeps float32 master weights, gradients and Adam moments


class Part(str, enum.Enum):
    """A part of a layered model: the embedding (`first`), one layer, the head and loss (`last`)."""
    EMBED = "embed"
    LAYER = "layer"
    HEAD = "head"


@runtime_checkable
class ModelFigures(Protocol):
    """What the planner's cost model (`cfp.planner.costmodel.CostModel`) reads of a model: per device at a
    tensor-parallel degree `tp`, per row of a micro-batch (a zoo model's row is one sequence) unless said
    otherwise. `ModelCost` writes them by hand for the zoo; `cfp.layered.facts.CostFacts` derives them from any
    `LayeredModel`'s traced and compiled parts. A layer's figure of a model of several layer kinds is their
    mean over its layers."""

    name: str
    num_layers: int
    seq_len: int          # tokens per row (tokens/s = rows/s x seq_len)
    dtype: str            # the dots' operand dtype ("float32", "bfloat16", ...)
    tp_divisor: int       # tensor-parallel degrees must divide it (the zoo: its attention heads)

    @property
    def act_bytes(self) -> int: ...                 # bytes per element of the activations

    def layer_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]: ...    # forward dots of one layer on mb rows
    def layer_weight_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]: ...  # those with a parameter operand
    def layer_weight_stash_bytes(self, tp: int = 1) -> float: ...      # per row, what a split backward's W keeps
    def head_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]: ...
    def embed_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]: ...
    def layer_elementwise_bytes(self, tp: int = 1) -> float: ...        # memory-bound bytes, forward
    def layer_score_bytes(self, tp: int = 1) -> float: ...              # the softmax passes among them
    def head_elementwise_bytes(self, tp: int = 1) -> float: ...
    def head_score_bytes(self, tp: int = 1) -> float: ...
    def embed_elementwise_bytes(self, tp: int = 1) -> tuple[float, float, float]: ...  # fwd; bwd per mb, per row
    def layer_flops(self, tp: int = 1) -> float: ...                    # forward, dots and elementwise
    def head_flops(self, tp: int = 1) -> float: ...
    def layer_backward_flops(self, tp: int = 1) -> float: ...           # the gradients' (no recomputation)
    def head_backward_flops(self, tp: int = 1) -> float: ...
    def model_flops_per_sequence(self) -> float: ...                    # dot FLOPs fwd + bwd per row, all parts
    def layer_params(self, tp: int = 1) -> float: ...                   # parameter elements
    def embed_params(self, tp: int = 1) -> float: ...
    def head_params(self, tp: int = 1) -> float: ...
    def param_bytes(self, part: Part, tp: int = 1) -> float: ...        # parameters (= their gradients)
    def optimizer_bytes(self, part: Part, tp: int = 1) -> float: ...    # the optimizer's state
    def layer_activation_bytes(self, tp: int = 1) -> float: ...         # kept for the backward
    def layer_temp_bytes(self, tp: int = 1) -> float: ...               # a layer backward's transients
    def head_activation_bytes(self, tp: int = 1) -> float: ...
    def embed_backward_bytes(self, tp: int = 1) -> float: ...           # per micro-batch
    def boundary_bytes(self) -> float: ...                              # the activation between stages
    def token_bytes(self) -> float: ...                                 # the first stage's input
    def layer_all_reduces(self, tp: int = 2) -> float: ...              # in activations (boundary_bytes)


def model_figures(model: Any, fused_attention: bool = False) -> ModelFigures:
    """`model` itself when it is `ModelFigures` (derived facts), else the zoo config's `ModelCost`."""
    if isinstance(model, ModelFigures) and not isinstance(model, ModelCost):
        if fused_attention:
            raise ConfigError(f"fused attention is a feature of the zoo's ModelCost; {model.name!r}'s derived "
                              "figures are what its own layers compile to")
        return model
    if isinstance(model, ModelCost):
        return model
    return ModelCost(model, fused_attention)


def model_name_of(config: Any) -> str:
    """The zoo's name of `config`'s family ("gpt", "llama2", "moe", "bert")."""
    for name, fam in MODEL_FAMILIES.items():
        if type(config) is fam.config_class:
            return name
    raise ConfigError(f"no model family has config type {type(config).__name__}; valid: "
                      f"{', '.join(f.config_class.__name__ for f in MODEL_FAMILIES.values())}")


@dataclasses.dataclass(frozen=True)
class Param:
    keys: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@functools.lru_cache(maxsize=64)
def param_parts(config: Any) -> dict[str, tuple[tuple[Param, ...], ...]]:
    """The model's parameters by part: "embed", "layers" (one tuple per layer kind), "head"."""
    kinds = 2 if isinstance(config, MoEConfig) else 1
    model = build_model(model_name_of(config), dataclasses.replace(config, num_layers=kinds))
    # shapes do not depend on the batch: one token per row, as many rows as a MoE group needs
    tokens = jax.ShapeDtypeStruct((getattr(config, "expert_group_size", 1), 1), jnp.int32)
    # the key made inside the trace: made eagerly it would run (and first compile) on a device
    like = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t), tokens)["params"]

    def flat(tree):
        return tuple(Param(path_keys(p), tuple(leaf.shape))
                     for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0])
    return {"embed": (flat(like["embed"]),), "layers": tuple(flat(like[f"layers_{i}"]) for i in range(kinds)),
            "head": (flat(like["head"]),)}


def _split_dim(p: Param, tp: int) -> int | None:
    return tensor_dim(p.keys, p.shape, tp)


def device_params(params: tuple[Param, ...], tp: int) -> float:
    """Per-device parameter count under the runtime's TP shardings."""
    return float(sum(p.size / (tp if _split_dim(p, tp) is not None else 1) for p in params))


def _kernel_gemm(p: Param, tp: int, tokens: float) -> Gemm | None:
    """The GEMM of a kernel on `tokens` rows, per device; None for non-kernels (biases, norms, tables)."""
    if p.keys[-1] not in ("kernel", "wi", "wo") and p.keys[-2:] != ("moe", "gate"):
        return None
    shape, d = list(p.shape), _split_dim(p, tp)
    if d is not None:
        shape[d] //= tp
    dims = param_dims(p.keys, len(shape))
    rows = tokens
    if dims[0] == "exp":                       # experts: rows are the capacity slots of each local expert
        rows, batch = tokens * shape[0], shape[0]
        shape = shape[1:]
        dims = dims[1:]
    else:
        batch = 1
    if dims[0] == "embed" or dims[0] is None:
        k, n = shape[0], math.prod(shape[1:])
    else:
        k, n = math.prod(shape[:-1]), shape[-1]
    return 2.0 * rows * k * n, (rows / batch, n, k)


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Per-sequence figures of one model config (FLOPs forward, bytes, parameter counts) at TP degree `tp`.
    `fused_attention`: the attention scores never reach memory (flash attention), as cfp's models do not."""
    config: Any
    fused_attention: bool = False

    def __post_init__(self):
        model_name_of(self.config)
        if not isinstance(self.fused_attention, bool):
            raise ConfigError(f"fused_attention={self.fused_attention!r} must be True or False")
        object.__setattr__(self, "_memo", {})

    def _m(self, key, fn):
        value = self._memo.get(key, _MISSING)
        if value is _MISSING:
            value = self._memo[key] = fn()
        return value

    # -- the model (`ModelFigures`)
    @property
    def name(self) -> str:
        return model_name_of(self.config)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def dtype(self) -> str:
        return self.config.dtype

    @property
    def tp_divisor(self) -> int:
        return self.config.num_heads

    # -- the family
    @property
    def llama(self) -> bool:
        return isinstance(self.config, LlamaConfig)

    @property
    def moe(self) -> bool:
        return isinstance(self.config, MoEConfig)

    @property
    def kv_heads(self) -> int:
        return self.config.num_kv_heads if self.llama else self.config.num_heads

    @property
    def act_bytes(self) -> int:
        return 2 if self.config.dtype == "bfloat16" else 4

    def _kinds(self) -> tuple[tuple[Param, ...], ...]:
        return param_parts(self.config)["layers"]

    def _heads(self, tp: int) -> tuple[float, float]:
        """(query heads, kv heads) per device: split where the TP degree divides them."""
        c = self.config
        return (c.num_heads / tp if c.num_heads % tp == 0 else c.num_heads,
                self.kv_heads / tp if self.kv_heads % tp == 0 else self.kv_heads)

    def _experts(self, tp: int) -> float:
        e = self.config.num_experts
        return e / tp if e % tp == 0 else e

    def _ffn(self, tp: int) -> float:
        f = self.config.ffn_size
        return f / tp if f % tp == 0 else f

    def _vocab(self, tp: int) -> float:
        v = self.config.vocab_size
        return v / tp if v % tp == 0 else v

    # -- parameters (per device)
    def layer_params(self, tp: int = 1) -> float:
        kinds = self._kinds()
        return self._m(("lp", tp), lambda: sum(device_params(k, tp) for k in kinds) / len(kinds))

    def embed_params(self, tp: int = 1) -> float:
        return self._m(("ep", tp), lambda: device_params(param_parts(self.config)["embed"][0], tp))

    def head_params(self, tp: int = 1) -> float:
        return self._m(("hp", tp), lambda: device_params(param_parts(self.config)["head"][0], tp))

    def param_bytes(self, part: Part, tp: int = 1) -> float:
        """float32 master weights (and as many gradient bytes)."""
        return PARAM_BYTES * {Part.EMBED: self.embed_params, Part.LAYER: self.layer_params,
                              Part.HEAD: self.head_params}[Part(part)](tp)

    def optimizer_bytes(self, part: Part, tp: int = 1) -> float:
        """AdamW's two float32 moments."""
        return 2 * self.param_bytes(part, tp)

    # -- dots
    def layer_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]:
        """(FLOPs, per-device GEMM shape) of each dot of one layer's forward on `mb` sequences (a MoE model's:
        both kinds', halved); a dot's backward GEMMs permute (m, n, k), which the rates treat alike."""
        return self._m(("lg", tp, mb), lambda: self._layer_gemms(tp, mb))

    def layer_weight_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]:
        """`layer_gemms`' dots with a parameter operand (a split backward's W computes their weight gradients:
        as many FLOPs as their forward)."""
        return self._m(("lwg", tp, mb), lambda: self._layer_gemms(tp, mb, kernels_only=True))

    def layer_weight_stash_bytes(self, tp: int = 1) -> float:
        """Bytes per sequence a split backward's W needs of one layer: each parameter dot's input and output
        gradient (a dot's FLOPs 2 rows k n give its rows), in the activation dtype."""
        def stash() -> float:
            return sum(f / (2 * k * n) * (k + n) for f, (_, n, k) in self.layer_weight_gemms(tp, 1)) * self.act_bytes
        return self._m(("lws", tp), stash)

    def _layer_gemms(self, tp: int, mb: int, kernels_only: bool = False) -> tuple[Gemm, ...]:
        c, s = self.config, self.config.seq_len
        t = mb * s
        heads, _ = self._heads(tp)
        attn = ((2 * mb * heads * s * s * c.head_dim, (s, s, c.head_dim)),       # scores
                (2 * mb * heads * s * s * c.head_dim, (s, c.head_dim, s)))       # probabilities x values
        kinds = self._kinds()
        out = []
        for params in kinds:
            routed = any(p.keys[-2] == "moe" for p in params)
            slots = t * c.num_experts * c.expert_capacity / c.expert_group_size if routed else 0.0
            for p in params:
                expert = p.keys[-1] in ("wi", "wo")
                g = _kernel_gemm(p, tp, slots / c.num_experts if expert else t)
                if g is not None:
                    out.append(g)
            if kernels_only:
                continue
            out += attn
            if routed:                                  # dispatch and combine einsums over local experts
                gsz, e_loc = c.expert_group_size, self._experts(tp)
                f = 2 * t * e_loc * c.expert_capacity * c.hidden_size
                out += [(f, (e_loc * c.expert_capacity, c.hidden_size, gsz)),
                        (f, (gsz, c.hidden_size, e_loc * c.expert_capacity))]
        share = 1.0 / len(kinds)
        return tuple((f * share, mnk) for f, mnk in out)

    def layer_dot_flops(self, tp: int = 1) -> float:
        return self._m(("ldf", tp), lambda: sum(f for f, _ in self.layer_gemms(tp, 1)))

    def layer_token_flops(self, tp: int = 1) -> float:
        """Forward dot FLOPs of one layer per token that do not grow with the sequence length: every dot but
        the attention einsums (projections, MLP or experts, MoE dispatch and combine)."""
        c, s = self.config, self.config.seq_len
        attention = 4 * self._heads(tp)[0] * s * s * c.head_dim
        return (self.layer_dot_flops(tp) - attention) / s

    def head_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]:
        t = mb * self.config.seq_len
        return self._m(("hg", tp, mb), lambda: tuple(
            g for p in param_parts(self.config)["head"][0] if (g := _kernel_gemm(p, tp, t)) is not None))

    def embed_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]:
        """The embedding is a gather: no dots."""
        return ()

    def head_dot_flops(self, tp: int = 1) -> float:
        """Forward dot FLOPs of the head per sequence (per token: divide by seq_len; they are all linear)."""
        return sum(f for f, _ in self.head_gemms(tp, 1))

    # -- memory-bound work, bytes read + written per sequence
    def layer_elementwise_bytes(self, tp: int = 1) -> float:
        """Softmax (float32 scores: mask, max, exp-sum, normalise ~4 passes), two norms and two residual adds
        (~12 hidden-size passes), the MLP activation (read + write; SwiGLU reads two), RoPE on q and k, and for
        MoE layers the routing masks (float32 [tokens, experts, capacity], built and read ~4 times)."""
        return self._m(("leb", tp), lambda: self._layer_elementwise_bytes(tp))

    def _layer_elementwise_bytes(self, tp: int) -> float:
        c, s, ab = self.config, self.config.seq_len, self.act_bytes
        heads, kv = self._heads(tp)
        base = self._score_bytes(heads, 4) + 12 * s * c.hidden_size * ab
        if self.llama:
            base += 3 * s * self._ffn(tp) * ab + 3 * s * (heads + kv) * c.head_dim * ab
        else:
            base += 2 * s * self._ffn(tp) * ab
        if not self.moe:
            return base
        e_loc = self._experts(tp)
        routing = 4 * 4 * s * c.num_experts * c.expert_capacity
        experts = 2 * s * c.num_experts * c.expert_capacity / c.expert_group_size * e_loc * c.ffn_size * ab
        dense = base
        moe = base - 2 * s * self._ffn(tp) * ab + routing + experts
        return (dense + moe) / 2

    def _score_bytes(self, heads: float, passes: int) -> float:
        """Bytes of `passes` float32 tensors of attention scores per sequence (none when fused)."""
        return 0.0 if self.fused_attention else passes * 4 * heads * self.config.seq_len ** 2

    def layer_score_bytes(self, tp: int = 1) -> float:
        """The part of `layer_elementwise_bytes` that is the attention softmax's float32 score passes (exp:
        on a CPU it runs well below memory speed; `GpuSpec.softmax_gbps`)."""
        return self._score_bytes(self._heads(tp)[0], 4)

    def layer_elementwise_flops(self, tp: int = 1) -> float:
        """Softmax (~5 per score), norms and residuals (~10 per hidden element), activation (~5 per MLP
        element), RoPE (~6 per q/k element): a rough count (for comparing with XLA's FLOP counts)."""
        c, s, h = self.config, self.config.seq_len, self.config.hidden_size
        heads, kv = self._heads(tp)
        rope = 6 * s * (heads + kv) * c.head_dim if self.llama else 0
        return 5 * heads * s * s + 5 * s * self._ffn(tp) + rope + 10 * s * h

    def layer_flops(self, tp: int = 1) -> float:
        return self.layer_dot_flops(tp) + self.layer_elementwise_flops(tp)

    def head_elementwise_bytes(self, tp: int = 1) -> float:
        """The final norm (BERT: the transform's GELU and norm too) and the float32 logits' log-softmax and
        loss (~3 passes over the logits)."""
        c, s = self.config, self.config.seq_len
        extra = 5 * s * c.hidden_size * self.act_bytes if isinstance(c, BertConfig) else 0.0
        return 3 * s * c.hidden_size * self.act_bytes + extra + 3 * 4 * s * self._head_vocab(tp)

    def head_score_bytes(self, tp: int = 1) -> float:
        """The part of `head_elementwise_bytes` that is the log-softmax over the logits (see
        `layer_score_bytes`)."""
        return 3 * 4 * self.config.seq_len * self._head_vocab(tp)

    def _head_vocab(self, tp: int) -> float:
        """Logit columns per device: the LM head is vocab-parallel where TP divides; BERT's decoder is not."""
        return self.config.vocab_size if isinstance(self.config, BertConfig) else self._vocab(tp)

    def head_flops(self, tp: int = 1) -> float:
        c, s = self.config, self.config.seq_len
        return self.head_dot_flops(tp) + 5 * s * self._head_vocab(tp) + 10 * s * c.hidden_size

    def embed_elementwise_bytes(self, tp: int = 1) -> tuple[float, float, float]:
        """(forward per sequence, backward per micro-batch, backward per sequence): the gather and position add
        (BERT: and its LayerNorm); the backward builds the token table's gradient densely (float32: zero it, scatter-add, add to the
        accumulator), its scatter of the rows' gradients not counted."""
        c = self.config
        # BERT's embedding ends in a LayerNorm: ~4 hidden-size passes more, as each norm of a layer is counted
        passes = 7 if isinstance(c, BertConfig) else 3
        return (passes * c.seq_len * c.hidden_size * self.act_bytes,
                3 * PARAM_BYTES * self._vocab(tp) * c.hidden_size, 0.0)

    def embed_backward_bytes(self, tp: int = 1) -> float:
        """The dense float32 gradient of the token table the embedding's backward builds."""
        return PARAM_BYTES * self.embed_params(tp)

    def layer_backward_flops(self, tp: int = 1) -> float:
        """Each forward dot's two gradient dots (and as much elementwise work): twice the forward."""
        return 2 * self.layer_flops(tp)

    def head_backward_flops(self, tp: int = 1) -> float:
        return 2 * self.head_flops(tp)

    def layer_temp_bytes(self, tp: int = 1) -> float:
        """Not counted by hand."""
        return 0.0

    def model_flops_per_sequence(self) -> float:
        """Dot FLOPs of forward + backward without recomputation (the MFU numerator)."""
        return 3 * (self.config.num_layers * self.layer_dot_flops(1) + self.head_dot_flops(1))

    # -- activations kept for the backward, bytes per sequence
    def layer_activation_bytes(self, tp: int = 1) -> float:
        """Hidden-size tensors (input, norms, residual), q/k/v/attention output, float32 scores and
        probabilities, MLP intermediates (MoE layers: the float32 dispatch and combine masks and the expert
        inputs and hidden units instead)."""
        return self._m(("lab", tp), lambda: self._layer_activation_bytes(tp))

    def _layer_activation_bytes(self, tp: int) -> float:
        c, s, h, ab = self.config, self.config.seq_len, self.config.hidden_size, self.act_bytes
        heads, kv = self._heads(tp)
        mlp_tensors = 4 if self.llama else 2
        attn = s * (5 * h + (heads + 2 * kv + heads) * c.head_dim) * ab + self._score_bytes(heads, 3)
        dense = attn + s * mlp_tensors * self._ffn(tp) * ab
        if not self.moe:
            return dense
        slots = s * c.num_experts * c.expert_capacity / c.expert_group_size
        local = slots * self._experts(tp) / c.num_experts
        moe = attn + 2 * 4 * s * c.num_experts * c.expert_capacity + local * (2 * h + 2 * c.ffn_size) * ab
        return (dense + moe) / 2

    def head_activation_bytes(self, tp: int = 1) -> float:
        return 3 * 4 * self.config.seq_len * self._head_vocab(tp)  # float32 logits, log-softmax, gradient

    def boundary_bytes(self) -> float:
        """Bytes per sequence of the activation (or its gradient) sent between stages."""
        return self.config.seq_len * self.config.hidden_size * self.act_bytes

    def token_bytes(self) -> float:
        """Bytes per sequence of the first stage's input: int32 token ids."""
        return self.config.seq_len * 4

    def layer_all_reduces(self, tp: int = 2) -> int:
        """Activation all-reduces of one layer's forward under TP: after attention and after the MLP (MoE
        layers: after the combine einsum, which sums over the experts split across the TP devices; GShard's
        all-to-all dispatch is a local slice there since every TP device holds all tokens)."""
        return 2
