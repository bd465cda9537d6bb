"""Model configs: frozen, validated dataclasses and a registry of named sizes.

``dtype`` is the *compute* dtype ("float32" or "bfloat16"); parameters are always
float32 master weights.  Optional sizes (``ffn_size``, ``num_kv_heads``) are resolved
in ``__post_init__`` so downstream code always sees plain ints.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from cfp.errors import ConfigError

DTYPES = ("float32", "bfloat16")


# --------------------------------------------------------------------------- validation
def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclass: normalise in place


def _pos_int(obj: Any, *names: str) -> None:
    cls = type(obj).__name__
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
            raise ConfigError(f"{cls}.{name}={v!r} must be a positive integer")
        _set(obj, name, int(v))


def _pos_float(obj: Any, *names: str, allow_zero: bool = False) -> None:
    cls = type(obj).__name__
    for name in names:
        v = getattr(obj, name)
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and (
            v >= 0 if allow_zero else v > 0)
        if not ok:
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{cls}.{name}={v!r} must be a number {bound}")
        _set(obj, name, float(v))


def _dtype(obj: Any) -> None:
    v = obj.dtype
    # Accept jnp.bfloat16 / np.float32 too, but store the canonical string so configs hash.
    try:
        name = v if isinstance(v, str) else np.dtype(v).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ConfigError(f"{type(obj).__name__}.dtype={v!r} is not supported; "
                          f"valid choices: {', '.join(DTYPES)}")
    _set(obj, "dtype", name)


def _heads(obj: Any) -> None:
    if obj.hidden_size % obj.num_heads:
        raise ConfigError(
            f"{type(obj).__name__}.hidden_size={obj.hidden_size} must be divisible by "
            f"num_heads={obj.num_heads}")


def _common(obj: Any) -> None:
    _pos_int(obj, "seq_len", "hidden_size", "num_layers", "num_heads", "vocab_size")
    if obj.ffn_size is None:
        _set(obj, "ffn_size", 4 * obj.hidden_size)
    _pos_int(obj, "ffn_size")
    _heads(obj)
    _dtype(obj)


# --------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 style decoder: pre-LN, learned positions, GELU MLP, untied LM head."""
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    ffn_size: Optional[int] = None  # None -> 4 * hidden_size
    dtype: str = "float32"

    def __post_init__(self):
        _common(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class LlamaConfig:
    """Llama-2 decoder: RMSNorm, RoPE, SwiGLU, optional grouped-query attention."""
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    ffn_size: int
    num_kv_heads: Optional[int] = None  # None -> num_heads; fewer -> GQA
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self):
        if self.ffn_size is None:
            raise ConfigError("LlamaConfig.ffn_size=None: Llama needs an explicit ffn_size "
                              "(e.g. 11008 for 7B)")
        _common(self)
        if self.num_kv_heads is None:
            _set(self, "num_kv_heads", self.num_heads)
        _pos_int(self, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig.num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError(
                f"LlamaConfig head_dim={self.head_dim} (hidden_size={self.hidden_size} / "
                f"num_heads={self.num_heads}) must be even for RoPE")
        _pos_float(self, "rope_theta", "norm_eps")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class MoEConfig:
    """GShard MoE decoder: GPT layers, every odd layer's MLP replaced by top-2 experts.

    Positional order matches CFP's ``MoEModelConfig(seq_len, hidden_size, num_layers,
    num_heads, vocab_size, num_experts, expert_group_size)``.
    """
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    num_experts: int
    expert_group_size: int
    capacity_factor: float = 2.0
    ffn_size: Optional[int] = None  # None -> 4 * hidden_size
    aux_loss_coef: float = 0.01
    dtype: str = "float32"

    def __post_init__(self):
        _common(self)
        _pos_int(self, "num_experts", "expert_group_size")
        if self.num_experts < 2:
            raise ConfigError(f"MoEConfig.num_experts={self.num_experts} must be >= 2 "
                              "for top-2 gating")
        _pos_float(self, "capacity_factor")
        _pos_float(self, "aux_loss_coef", allow_zero=True)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def expert_capacity(self) -> int:
        """Slots per expert per group: capacity_factor * group / experts (Mesh-TF rule).

        With top-2 and the default factor 2.0 this is GShard's 2N/E.
        """
        c = int(self.capacity_factor * self.expert_group_size / self.num_experts)
        return max(1, min(c, self.expert_group_size))


MoEModelConfig = MoEConfig


@dataclass(frozen=True)
class BertConfig:
    """BERT encoder: post-LN, bidirectional attention, MLM head; [MASK] = vocab_size-1."""
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    ffn_size: Optional[int] = None  # None -> 4 * hidden_size
    mask_prob: float = 0.15
    dtype: str = "float32"

    def __post_init__(self):
        _common(self)
        if self.vocab_size < 2:
            raise ConfigError(f"BertConfig.vocab_size={self.vocab_size} must be >= 2 "
                              "(the last id is [MASK])")
        m = self.mask_prob
        if isinstance(m, bool) or not isinstance(m, numbers.Real) or not 0 < m <= 1:
            raise ConfigError(f"BertConfig.mask_prob={m!r} must be in (0, 1]")
        _set(self, "mask_prob", float(m))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mask_id(self) -> int:
        return self.vocab_size - 1


Config = Union[GPTConfig, LlamaConfig, MoEConfig, BertConfig]

# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class ModelFamily:
    """One model family of the zoo: its config class and the module defining its Embed/Layer/Head/Model."""

    config_class: type
    module: str


# the one model registry: the CLI, the model API and the configs below all read it
MODEL_FAMILIES: dict[str, ModelFamily] = {
    "gpt": ModelFamily(GPTConfig, "cfp.models.gpt"),
    "llama2": ModelFamily(LlamaConfig, "cfp.models.llama"),
    "moe": ModelFamily(MoEConfig, "cfp.models.moe"),
    "bert": ModelFamily(BertConfig, "cfp.models.bert"),
}
MODEL_NAMES = tuple(MODEL_FAMILIES)
CONFIG_CLASSES = {name: f.config_class for name, f in MODEL_FAMILIES.items()}


def _gpt(seq, hidden, layers, heads, vocab=51200):
    return GPTConfig(seq, hidden, layers, heads, vocab)


def _moe(seq, hidden, layers, heads, vocab, experts, group):
    return MoEConfig(seq, hidden, layers, heads, vocab, experts, group)


CONFIGS: dict[str, dict[str, Config]] = {
    "gpt": {
        "tiny": _gpt(64, 64, 2, 4, 512),
        "small": _gpt(128, 256, 4, 8, 2048),
        # Alpa / CFP GPT benchmark sizes.
        "125M": _gpt(1024, 768, 12, 12),
        "350M": _gpt(1024, 1024, 24, 16),
        "760M": _gpt(1024, 1536, 24, 16),
        "1.3B": _gpt(1024, 2048, 24, 32),
        "2.6B": _gpt(1024, 2560, 32, 32),
        "6.7B": _gpt(1024, 4096, 32, 32),
        # CFP's model "F": 6.7B-wide layers, few of them (override num_layers as needed).
        "F": _gpt(1024, 4096, 2, 32),
    },
    "llama2": {
        "tiny": LlamaConfig(64, 64, 2, 4, 512, ffn_size=176, num_kv_heads=2),
        "small": LlamaConfig(128, 256, 4, 8, 2048, ffn_size=688, num_kv_heads=4),
        "7B": LlamaConfig(4096, 4096, 32, 32, 32000, ffn_size=11008),
        "13B": LlamaConfig(4096, 5120, 40, 40, 32000, ffn_size=13824),
        # Hydraulis' largest model; LLaMA-33B widths (hidden 6656, 60 layers, 52 heads, FFN 17920).
        "32B": LlamaConfig(4096, 6656, 60, 52, 32000, ffn_size=17920),
        # LLaMA 33B ("30B"; Touvron et al. 2023, Table 2; ffn from its released config) and Llama-2 70B
        # (Touvron et al. 2023b: grouped-query attention with 8 KV heads).
        "30B": LlamaConfig(2048, 6656, 60, 52, 32000, ffn_size=17920),
        "70B": LlamaConfig(4096, 8192, 80, 64, 32000, ffn_size=28672, num_kv_heads=8),
    },
    "moe": {
        "tiny": _moe(64, 64, 2, 4, 512, 4, 64),
        "small": _moe(128, 256, 4, 8, 2048, 8, 256),
        "paper": _moe(1024, 1280, 16, 4, 32000, 32, 2048),
        "paper-2head": _moe(1024, 1280, 16, 2, 32000, 32, 2048),
    },
    "bert": {
        "tiny": BertConfig(64, 64, 2, 4, 512),
        "small": BertConfig(128, 256, 4, 8, 2048),
        "base": BertConfig(512, 768, 12, 12, 30522),
        "large": BertConfig(512, 1024, 24, 16, 30522),
    },
}


def check_model_name(model: str) -> str:
    """Return ``model`` if it is a known model name, else raise ConfigError."""
    if model not in MODEL_NAMES:
        raise ConfigError(f"unknown model {model!r}; valid choices: {', '.join(MODEL_NAMES)}")
    return model


def get_config(model: str, name: str = "tiny", **overrides: Any) -> Config:
    """Named config of ``model`` with field overrides, e.g. ``get_config("gpt", "F", num_layers=4)``.

    Derived defaults follow their source: overriding ``hidden_size`` re-derives an
    ``ffn_size`` that was 4*hidden, overriding ``num_heads`` re-derives a
    ``num_kv_heads`` that equalled num_heads.
    """
    check_model_name(model)
    table = CONFIGS[model]
    if name not in table:
        raise ConfigError(f"unknown {model} config {name!r}; valid choices: "
                          f"{', '.join(table)}")
    base = table[name]
    fields = [f.name for f in dataclasses.fields(base)]
    bad = [k for k in overrides if k not in fields]
    if bad:
        raise ConfigError(f"unknown {type(base).__name__} field(s) {', '.join(map(repr, bad))}; "
                          f"valid choices: {', '.join(fields)}")
    if not overrides:
        return base
    if ("hidden_size" in overrides and "ffn_size" not in overrides
            and not isinstance(base, LlamaConfig)
            and base.ffn_size == 4 * base.hidden_size):
        overrides["ffn_size"] = None
    if ("num_heads" in overrides and "num_kv_heads" not in overrides
            and isinstance(base, LlamaConfig) and base.num_kv_heads == base.num_heads):
        overrides["num_kv_heads"] = None
    return dataclasses.replace(base, **overrides)
