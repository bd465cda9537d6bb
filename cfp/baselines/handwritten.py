"""Hand-written baseline layouts of a train step `step(params, opt_state, batch)` on a device mesh.

Each baseline gives a `PartitionSpec` for every flat input (parameters, optimizer state, batch), chosen from
the leaf's pytree path and shape, and is run with `jax.jit(step, in_shardings=..., out_shardings=...)`:

* data-parallel: parameters and optimizer state replicated, batch dim 0 sharded over every mesh axis;
* fsdp (ZeRO-3 style): as data parallel, plus every parameter / optimizer-state leaf sharded over every mesh
  axis on its largest divisible dim (leaves with no divisible dim stay replicated);
* megatron-tp: Megatron-LM tensor parallelism over every mesh axis, by the one rule table
  `cfp.sharding.rules` (column-parallel q/k/v, fc_in, gate, up; row-parallel attention out, fc_out, down;
  expert-parallel MoE weights; vocab-parallel embedding and LM head where the vocabulary divides); batch
  replicated;
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
from cfp.sharding.rules import dim_spec, path_keys, tensor_spec


class Baseline(str, enum.Enum):
    DATA_PARALLEL = "data-parallel"
    FSDP = "fsdp"
    MEGATRON_TP = "megatron-tp"
    DP_TP = "dp-tp"


def _param_keys(path) -> list[str] | None:
    """The keys under `params` (e.g. ['layers_0', 'attn', 'query', 'kernel']), or None for a non-parameter."""
    keys = list(path_keys(path))
    return keys[keys.index("params") + 1:] if "params" in keys else None


def _axes(names: Sequence[str]):
    return names[0] if len(names) == 1 else tuple(names)


def _fsdp(shape: tuple[int, ...], axes, n: int) -> P:
    dims = sorted((d for d in range(len(shape)) if shape[d] % n == 0), key=lambda d: (-shape[d], d))
    return dim_spec(dims[0] if dims else None, axes)


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
            return tensor_spec(keys, shape, tp_axes, tp, strict=True)
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
        return dim_spec(0, dp_axes)

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

