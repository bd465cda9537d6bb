"""Per-step strategy switch: move training state (parameters and optimizer state) to a new layout, exactly.

A layout here is the tensor-parallel sharding of one pipeline's mesh (cfp.runtime.sharding). Resharding is a
copy (jax.device_put between shardings), so values are bit-identical before and after a switch.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cfp.runtime.sharding import param_specs


def state_shardings(params: Any, opt_state: Any, mesh: Mesh) -> tuple[Any, Any]:
    """Shardings of (params, opt_state) on `mesh` (axis "tp"): optimizer subtrees shaped like the parameters
    (Adam's moments) follow the parameters; everything else (step counts) is replicated."""
    tp = mesh.shape.get("tp", 1)
    pshard = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(params, tp),
                                    is_leaf=lambda x: isinstance(x, P))
    ptree = jax.tree_util.tree_structure(params)

    def like_params(x):
        return jax.tree_util.tree_structure(x) == ptree

    oshard = jax.tree_util.tree_map(
        lambda x: pshard if like_params(x) else NamedSharding(mesh, P()), opt_state, is_leaf=like_params)
    return pshard, oshard


def reshard(tree: Any, shardings: Any) -> Any:
    """`tree` placed with `shardings` (a copy across devices when they differ; values unchanged)."""
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, s), tree, shardings)


def switch_state(params: Any, opt_state: Any, mesh: Mesh) -> tuple[Any, Any]:
    """(params, opt_state) resharded to the layout of `mesh`."""
    pshard, oshard = state_shardings(params, opt_state, mesh)
    return reshard(params, pshard), reshard(opt_state, oshard)
