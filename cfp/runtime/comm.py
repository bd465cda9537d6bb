"""Moving activations, gradients and parameters between stages.

Inside one process a move is ``jax.device_put`` onto the destination's sharding (XLA copies between
devices; arrays arrive replicated over the destination's TP axis, whatever the source's TP degree).

Across processes (multi-controller JAX: each process addresses only its own devices) a move is a
jitted collective over a 2-device mesh ``[source device 0, destination device 0]``: both processes
build the same global ``[2, ...]`` array (the sender contributes the data, the receiver zeros) and run
``a[0]`` replicated over the mesh, which XLA lowers to a broadcast between the two devices.  The
receiver then ``device_put``s its copy onto the destination stage's sharding.  Every process walks the
same global action order, so both sides issue the same collectives in the same order; processes that
own neither end skip the move.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cfp.runtime.cliques import meet_before_first_collective


def _local(device) -> bool:
    return device.process_index == jax.process_index()


@functools.lru_cache(maxsize=None)
def _pair_program(src, dst):
    mesh = Mesh(np.array([src, dst]), ("pair",))
    split = NamedSharding(mesh, P("pair"))
    repl = NamedSharding(mesh, P())
    fn = jax.jit(lambda tree: jax.tree_util.tree_map(lambda a: a[0], tree), out_shardings=repl)
    return mesh, split, fn


def _first_shard(a: jax.Array):
    """A single-device copy of a replicated array (its first addressable shard)."""
    return a.addressable_shards[0].data


def move(tree: Optional[Any], src_devices: list, dst_devices: list, dst_shardings: Any,
         like: Any) -> Optional[Any]:
    """Move ``tree`` (held replicated-or-sharded on ``src_devices``) onto ``dst_shardings``.

    ``like`` is the tree of ShapeDtypeStructs (needed by a receiver that does not hold the data).
    Returns the moved tree on the destination's process, None elsewhere.
    """
    src_local, dst_local = _local(src_devices[0]), _local(dst_devices[0])
    if src_local and dst_local:
        return jax.device_put(tree, dst_shardings)
    if not (src_local or dst_local):
        return None
    src, dst = src_devices[0], dst_devices[0]
    _, split, fn = _pair_program(src, dst)

    def global_array(leaf_like, leaf):
        shape = (2,) + tuple(leaf_like.shape)
        if src_local:  # gather to one device first (the value may be TP-sharded)
            piece = jax.device_put(jnp.asarray(leaf)[None], src)
        else:
            piece = jax.device_put(jnp.zeros((1,) + tuple(leaf_like.shape), leaf_like.dtype), dst)
        return jax.make_array_from_single_device_arrays(shape, split, [piece])

    leaves_like, treedef = jax.tree_util.tree_flatten(like)
    leaves = jax.tree_util.tree_leaves(tree) if src_local else [None] * len(leaves_like)
    arrays = [global_array(l, v) for l, v in zip(leaves_like, leaves)]
    meet_before_first_collective([src, dst], ready=arrays)   # the pair's gloo context: both ends within 30 s
    out = fn(jax.tree_util.tree_unflatten(treedef, arrays))
    if not dst_local:
        return None
    local = jax.tree_util.tree_map(_first_shard, out)
    return jax.device_put(local, dst_shardings)
