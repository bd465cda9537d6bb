"""Hand-written baseline layouts of a train step `step(params, opt_state, batch)` on a device mesh.

Each baseline gives a `PartitionSpec` for every flat input (parameters, optimizer state, batch), chosen from
the leaf's pytree path and shape, and is run with `jax.jit(step, in_shardings=..., out_shardings=...)`:

* data-parallel: parameters and optimizer state replicated, batch dim 0 sharded over every mesh axis;
* fsdp (ZeRO-3 style): as data parallel, plus every parameter / optimizer-state leaf sharded over every mesh
  axis on its largest divisible dim (leaves with no divisible dim stay replicated);
* megatron-tp: Megatron-LM tensor parallelism over every mesh axis: column-parallel q/k/v, fc_in, gate, up
  and MoE `wi` (output features / heads sharded), row-parallel attention out, fc_out, down and MoE `wo`,
  vocab-parallel embedding and LM head where the vocabulary divides; batch replicated;
* dp-tp: 2-D meshes only: batch over axis 0, the megatron-tp layout over axis 1.

Optimizer-state leaves mirror their parameter (matched by the path after `['params']`).
"""
from __future__ import annotations

import enum
import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cfp.errors import ConfigError


class Baseline(str, enum.Enum):
    DATA_PARALLEL = "data-parallel"
    FSDP = "fsdp"
    MEGATRON_TP = "megatron-tp"
    DP_TP = "dp-tp"


# Megatron roles by the module name that owns a kernel/bias: which kernel dim is sharded.
_COLUMN = {"query", "key", "value", "fc_in", "gate", "up"}
_ROW = {"out", "fc_out", "down"}


def _keys(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _param_keys(path) -> list[str] | None:
    """The keys under `params` (e.g. ['layers_0', 'attn', 'query', 'kernel']), or None for a non-parameter."""
    keys = _keys(path)
    return keys[keys.index("params") + 1:] if "params" in keys else None


def _axes(names: Sequence[str]):
    return names[0] if len(names) == 1 else tuple(names)


def _spec(rank: int, dim: int | None, axes) -> P:
    if dim is None:
        return P()
    entries = [None] * (dim + 1)     # no trailing Nones: P('x') rather than P('x', None)
    entries[dim] = axes
    return P(*entries)


def _megatron(keys: list[str], shape: tuple[int, ...], tp_axes, tp: int) -> P:
    """Megatron layout of one parameter; raises ConfigError where a sharded dim does not divide."""
    leaf, owner = keys[-1], (keys[-2] if len(keys) >= 2 else "")
    where = "/".join(keys)
    rank = len(shape)

    def need(dim: int, what: str) -> P:
        if shape[dim] % tp:
            raise ConfigError(f"megatron layout: {what}={shape[dim]} of {where} {shape} is not divisible by "
                              f"the tensor-parallel size {tp}")
        return _spec(rank, dim, tp_axes)

    if owner in ("query", "key", "value"):
        # kernel [H, heads, D] / bias [heads, D]: split heads (Megatron's column-parallel attention)
        what = "num_kv_heads" if owner != "query" else "num_heads"
        return need(1 if leaf == "kernel" else 0, what)
    if owner == "out" and leaf == "kernel" and rank == 3:
        return need(0, "num_heads")               # [heads, D, H]: row-parallel
    if owner in _COLUMN:
        return need(rank - 1, "ffn_size")         # kernel [H, F] / bias [F]
    if owner in _ROW:
        return need(0, "ffn_size") if leaf == "kernel" else P()   # bias added after the all-reduce
    if leaf == "wi" and rank == 3:
        return need(2, "ffn_size")                # MoE experts [E, H, F]
    if leaf == "wo" and rank == 3:
        return need(1, "ffn_size")                # [E, F, H]
    # vocab-parallel embedding / LM head only where the vocabulary divides (not part of Megatron's contract)
    if owner == "token" and leaf == "embedding" and shape[0] % tp == 0:
        return _spec(rank, 0, tp_axes)
    if owner == "lm_head" and leaf == "kernel" and shape[-1] % tp == 0:
        return _spec(rank, rank - 1, tp_axes)
    return P()


def _fsdp(shape: tuple[int, ...], axes, n: int) -> P:
    dims = sorted((d for d in range(len(shape)) if shape[d] % n == 0), key=lambda d: (-shape[d], d))
    return _spec(len(shape), dims[0] if dims else None, axes)


def baseline_specs(name: str | Baseline, example_args: Sequence[Any], mesh: Mesh,
                   model_name: str = "") -> Any:
    """PartitionSpecs (pytree like `example_args`) of baseline `name` for `step(params, opt_state, batch)`."""
    try:
        kind = Baseline(name)
    except ValueError:
        raise ConfigError(f"unknown baseline {name!r}; valid choices: {', '.join(b.value for b in Baseline)}")
    if len(example_args) != 3:
        raise ConfigError(f"baselines expect step(params, opt_state, batch), got {len(example_args)} arguments")
    names = tuple(mesh.axis_names)
    sizes = tuple(mesh.devices.shape)
    if kind is Baseline.DP_TP and len(names) != 2:
        raise ConfigError(f"dp-tp needs a 2-D mesh (DP over axis 0, TP over axis 1), got mesh shape {sizes}")
    if kind is Baseline.DP_TP:
        dp_axes, dp = names[0], sizes[0]
        tp_axes, tp = names[1], sizes[1]
    else:
        dp_axes, dp = _axes(names), math.prod(sizes)
        tp_axes, tp = _axes(names), math.prod(sizes)
    if kind is Baseline.MEGATRON_TP:
        dp_axes, dp = None, 1

    def param_spec(keys: list[str], shape: tuple[int, ...]) -> P:
        if kind in (Baseline.MEGATRON_TP, Baseline.DP_TP):
            return _megatron(keys, shape, tp_axes, tp)
        if kind is Baseline.FSDP:
            return _fsdp(shape, dp_axes, dp)
        return P()

    params, opt_state, batch = example_args
    label = f"{model_name} " if model_name else ""

    def for_state(path, x):
        keys = _param_keys(path)
        shape = tuple(getattr(x, "shape", ()))
        if keys is None or not shape:
            return P()                            # step counters and the like
        return param_spec(keys, shape)

    def for_batch(path, x):
        shape = tuple(getattr(x, "shape", ()))
        if dp_axes is None or not shape:
            return P()
        if shape[0] % dp:
            raise ConfigError(f"{kind.value}: {label}batch size {shape[0]} (batch{jax.tree_util.keystr(path)}) "
                              f"is not divisible by the data-parallel size {dp}")
        return _spec(len(shape), 0, dp_axes)

    return (jax.tree_util.tree_map_with_path(for_state, params),
            jax.tree_util.tree_map_with_path(for_state, opt_state),
            jax.tree_util.tree_map_with_path(for_batch, batch))


def baseline_shardings(name: str | Baseline, example_args: Sequence[Any], mesh: Mesh, model_name: str = "") -> Any:
    """NamedShardings (pytree like `example_args`) of baseline `name`; ConfigError where it does not apply."""
    specs = baseline_specs(name, example_args, mesh, model_name)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def baseline_step(name: str | Baseline, step_fn, example_args: Sequence[Any], mesh: Mesh, model_name: str = ""):
    """`(jitted_step, in_shardings)`: the step jitted under the baseline; new params/state keep their layout."""
    shardings = baseline_shardings(name, example_args, mesh, model_name)
    out = (shardings[0], shardings[1], NamedSharding(mesh, P()))
    return jax.jit(step_fn, in_shardings=shardings, out_shardings=out), shardings

