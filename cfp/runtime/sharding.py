"""Megatron-style tensor-parallel shardings of a stage's parameters over its ``tp`` mesh axis.

The rules themselves are `cfp.sharding.rules` (shared with the baselines and the planner); here they are
bound to a stage's 1-D ``tp`` mesh, leniently: a dim that ``tp`` does not divide (e.g. 2 KV
heads under TP 4) stays replicated. Shardings decide speed and memory, not the program's meaning: the
partitioner keeps the computation, only the order of floating-point sums may change.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from cfp.sharding.rules import path_keys, tensor_spec

TP_AXIS = "tp"
CP_AXIS = "cp"


def stage_mesh(devices: list, cp: int = 1) -> Mesh:
    """A stage's mesh: 1-D ("tp",) without context parallelism, ("cp", "tp") (cp-major device order)
    with it; Auto axes so sharding constraints are hints to GSPMD."""
    if cp == 1:
        return Mesh(np.array(devices), (TP_AXIS,), axis_types=(AxisType.Auto,))
    return Mesh(np.array(devices).reshape(cp, -1), (CP_AXIS, TP_AXIS),
                axis_types=(AxisType.Auto, AxisType.Auto))


def param_specs(params: Any, tp: int) -> Any:
    """PartitionSpec tree for ``params`` (a tree of arrays or ShapeDtypeStructs) under TP ``tp``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: tensor_spec(path_keys(path), tuple(leaf.shape), TP_AXIS, tp), params)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    tp = mesh.shape[TP_AXIS]
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(params, tp),
                                  is_leaf=lambda x: isinstance(x, P))
