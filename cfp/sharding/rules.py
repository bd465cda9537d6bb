"""The one table of Megatron-style tensor parallelism: which logical dim of a parameter takes the tensor
axes, for the baselines (`megatron-tp`, `dp-tp`), the pipeline runtime's stages and the planner alike.

Models name their parameters' dims (`cfp.models.dims`); `TENSOR_RULES` maps names to the tensor-parallel mesh
axes, in priority order: a parameter takes the axes on the first of its named dims that a rule lists and the
tensor-parallel size divides. That gives Megatron-LM's column-parallel q/k/v, fc_in, gate and up (heads or
output features), row-parallel attention out, fc_out and down (input features; their biases are added
after the all-reduce, replicated), vocab-parallel embedding and LM head, and expert-parallel MoE weights.

MoE `wi`/`wo` ([E, H, F], [E, F, H]) take the axes on the expert dim ("exp" before "mlp"), decided by
measurement (`benchmarks/moe_wi.py`, tiny MoE train step, batch 16, 8 simulated CPU devices, 20 round-robin
rounds): TP 4 61.1 ms, 12.65 MB per device with experts sharded vs 72.7 ms, 14.63 MB with the ffn dim
sharded; DP 2 x TP 4 67.4 ms, 6.88 MB vs 68.3 ms, 7.96 MB (times measured on a shared 2-core host, memory
from the compiled steps).

A rule marked `required` is part of the Megatron contract: `strict` callers (the baselines) raise where it does
not divide; lenient ones (the runtime, where shardings only decide speed) leave the parameter replicated.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec

from cfp.errors import ConfigError
from cfp.models.dims import DIM_FIELDS, param_dims


@dataclasses.dataclass(frozen=True)
class Rule:
    dim: str            # a logical dim name of `cfp.models.dims`
    required: bool      # part of the Megatron contract: strict callers raise when it does not divide


TENSOR_RULES: tuple[Rule, ...] = (
    Rule("exp", required=False),
    Rule("heads", required=True),
    Rule("kv_heads", required=True),
    Rule("mlp", required=True),
    Rule("vocab", required=False),
)


def path_keys(path) -> tuple[str, ...]:
    """A pytree key path as plain key names, e.g. ('0', 'params', 'layers_0', 'attn', 'query', 'kernel')."""
    return tuple(jax.tree_util.keystr(path, simple=True, separator="/").split("/")) if path else ()


# Other spellings of the rules' dims in users' logical axis names (Flax / MaxText vocabularies): a name is
# looked up here first, so a model written with `nn.with_logical_partitioning(..., ("embed", "q_heads"))` gets
# the same rules as the zoo.
ALIASES: dict[str, str] = {"q_heads": "heads", "query_heads": "heads", "kv_head": "kv_heads", "expert": "exp",
                           "experts": "exp", "ffn": "mlp", "hidden_mlp": "mlp"}


def names_tensor_dim(names: Sequence[str | None] | None, shape: Sequence[int], tp: int, strict: bool = False,
                     rules: Sequence[Rule] = TENSOR_RULES, what: str = "") -> int | None:
    """The dim of a parameter of `shape` whose logical dim `names` a rule lists first and the tensor-parallel size
    `tp` divides, or None (replicated; also with no names). `strict` raises ConfigError where a required rule's
    dim does not divide."""
    if tp <= 1 or not names or len(names) != len(shape):
        return None
    dims = [ALIASES.get(n, n) for n in names]
    for rule in rules:
        if rule.dim not in dims:
            continue
        d = dims.index(rule.dim)
        if shape[d] % tp == 0:
            return d
        if strict and rule.required:
            raise ConfigError(f"megatron layout: {DIM_FIELDS.get(rule.dim, rule.dim)}={shape[d]} of {what} "
                              f"{tuple(shape)} is not divisible by the tensor-parallel size {tp}")
    return None


def tensor_dim(keys: Sequence[str], shape: Sequence[int], tp: int, strict: bool = False,
               rules: Sequence[Rule] = TENSOR_RULES) -> int | None:
    """The dim of the zoo parameter at `keys` with `shape` that takes the tensor-parallel axes of size `tp`, or None
    (replicated): `names_tensor_dim` of its names in `cfp.models.dims`."""
    if tp <= 1:
        return None
    return names_tensor_dim(param_dims(keys, len(shape)), shape, tp, strict, rules, "/".join(keys))


def dim_spec(dim: int | None, axes: Any) -> PartitionSpec:
    """PartitionSpec that puts mesh `axes` (a name or a tuple of names) on `dim`, nothing else; no trailing
    Nones, so P('x') rather than P('x', None)."""
    if dim is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * dim + [axes]))


def tensor_spec(keys: Sequence[str], shape: Sequence[int], axes: Any, tp: int, strict: bool = False,
                rules: Sequence[Rule] = TENSOR_RULES) -> PartitionSpec:
    """The parameter's PartitionSpec with the tensor-parallel mesh `axes` (of total size `tp`)."""
    return dim_spec(tensor_dim(keys, shape, tp, strict, rules), axes)
