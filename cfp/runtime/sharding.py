"""Megatron-style tensor-parallel shardings of a stage's parameters over its ``tp`` mesh axis.

Column-parallel projections (q/k/v, fc_in, gate, up, LM head) split their output features (for q/k/v
the heads axis), row-parallel ones (attention out, fc_out, down) split their input features, so one
attention block or MLP needs a single all-reduce, which GSPMD inserts.  MoE expert weights split the
expert axis.  A dimension that ``tp`` does not divide (e.g. 2 KV heads under TP 4) stays replicated:
shardings only decide speed, never the numbers, because the partitioner keeps the program's meaning.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

TP_AXIS = "tp"
COLUMN = frozenset({"query", "key", "value", "fc_in", "gate", "up", "lm_head", "wi", "wi_0", "wi_1"})
ROW = frozenset({"out", "fc_out", "down", "wo"})
EXPERT = frozenset({"wi", "wo"})  # MoE [experts, in, out] parameters


def stage_mesh(devices: list) -> Mesh:
    """1-D mesh over a stage's devices; Auto axes so sharding constraints are hints to GSPMD."""
    return Mesh(np.array(devices), (TP_AXIS,), axis_types=(AxisType.Auto,))


def _axis_for(path: tuple[str, ...], shape: tuple[int, ...]) -> int | None:
    """The axis to shard for a parameter at ``path`` (module names..., leaf name), or None."""
    leaf = path[-1]
    module = path[-2] if len(path) > 1 else ""
    if (leaf in EXPERT or any("expert" in p for p in path)) and len(shape) == 3:
        return 0  # [experts, in, out]: expert-parallel inside the TP group
    if module in COLUMN:
        if leaf == "kernel":
            return 1  # [in, out] or [in, heads, head_dim]
        if leaf == "bias":
            return 0  # [out] or [heads, head_dim]
    if module in ROW and leaf == "kernel":
        return 0  # [in, out] or [heads, head_dim, out]
    return None


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_specs(params: Any, tp: int) -> Any:
    """PartitionSpec tree for ``params`` (a tree of arrays or ShapeDtypeStructs) under TP ``tp``."""
    def spec(path, leaf):
        shape = tuple(leaf.shape)
        axis = _axis_for(_names(path), shape) if tp > 1 else None
        if axis is None or axis >= len(shape) or shape[axis] % tp:
            return P()
        return P(*([None] * axis + [TP_AXIS]))
    return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    tp = mesh.shape[TP_AXIS]
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(params, tp),
                                  is_leaf=lambda x: isinstance(x, P))
