"""Megatron-style tensor-parallel shardings of a stage's parameters over its ``tp`` mesh axis.

The rules themselves are `cfp.sharding.rules` (shared with the baselines and the planner), applied to the
logical dim names a model gives its parameters (`LayeredModel.logical_names`; the zoo's come from
`cfp.models.dims`); here they are bound to a stage's ``tp`` mesh axis, leniently: a dim that ``tp`` does not
divide (e.g. 2 KV heads under TP 4) stays replicated, and so does every parameter without names. Shardings
decide speed and memory, not the program's meaning: the partitioner keeps the computation, only the order of
floating-point sums may change.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from cfp.sharding.rules import dim_spec, names_tensor_dim

TP_AXIS = "tp"
CP_AXIS = "cp"


def stage_mesh(devices: list, cp: int = 1) -> Mesh:
    """A stage's mesh: 1-D ("tp",) without context parallelism, ("cp", "tp") (cp-major device order)
    with it; Auto axes so sharding constraints are hints to GSPMD."""
    if cp == 1:
        return Mesh(np.array(devices), (TP_AXIS,), axis_types=(AxisType.Auto,))
    return Mesh(np.array(devices).reshape(cp, -1), (CP_AXIS, TP_AXIS),
                axis_types=(AxisType.Auto, AxisType.Auto))


def is_names(t: Any) -> bool:
    """Whether ``t`` is one parameter's logical dim names (a tuple of str/None)."""
    return isinstance(t, tuple) and all(n is None or isinstance(n, str) for n in t)


def param_specs(params: Any, names: Optional[Any], tp: int) -> Any:
    """PartitionSpec tree for ``params`` (arrays or ShapeDtypeStructs) under TP ``tp``, from ``names`` (the tree
    of ``params`` with each leaf's logical dim names; None: all replicated)."""
    if names is None or tp <= 1:
        return jax.tree_util.tree_map(lambda _: P(), params)
    table = {jax.tree_util.keystr(p): n for p, n in
             jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda t: t is None or is_names(t))[0]}
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: dim_spec(names_tensor_dim(table.get(jax.tree_util.keystr(path)),
                                                     tuple(leaf.shape), tp), TP_AXIS), params)


def param_shardings(params: Any, names: Optional[Any], mesh: Mesh) -> Any:
    tp = mesh.shape[TP_AXIS]
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(params, names, tp),
                                  is_leaf=lambda x: isinstance(x, P))
