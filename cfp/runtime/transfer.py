"""Moving arrays between device groups that may belong to different processes (pipeline stage boundaries).

Why not `jax.device_put`: with multi-process CPU (gloo), a `device_put` whose target devices belong to
another process fails with "UNIMPLEMENTED: Cross-host transfers are not supported by this backend"; the
suggested `jax_cross_host_transfer_socket_address` path hangs on the receiver in jax 0.10.2. What works is
a collective: a jitted `shard_map` with `lax.ppermute` over a mesh that stacks the source and destination
devices, which gloo runs as point-to-point send/recv between the paired devices.

:func:`transfer` is collective over the processes owning source or destination devices: each of them must
call it, in the same order, with the same shardings. The sender passes the array; a receiver that owns no
source devices passes ``jax.ShapeDtypeStruct(shape, dtype, sharding=src_sharding)``. Processes owning none
of those devices need not call it.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cfp.errors import ConfigError

_AXIS = "_cfp_xfer"


@functools.lru_cache(maxsize=256)
def _pair_fn(src_mesh: Mesh, dst_mesh: Mesh, spec: P):
    both = Mesh(np.stack([src_mesh.devices, dst_mesh.devices]), (_AXIS,) + tuple(src_mesh.axis_names))
    full = P(_AXIS, *spec)
    # row 0 (source devices) sends its block to row 1 (paired destination devices); row 0 gets zeros
    body = jax.shard_map(lambda a: jax.lax.ppermute(a, _AXIS, [(0, 1)]), mesh=both, in_specs=full,
                         out_specs=full)
    return both, NamedSharding(both, full), jax.jit(body)


@functools.lru_cache(maxsize=64)
def _zeros(device, shape: tuple, dtype) -> jax.Array:
    # the receiver's input block is only a placeholder (ppermute overwrites it), so one per shape is reused
    return jax.device_put(np.zeros(shape, dtype), device)


def _as_named(s, what: str) -> NamedSharding:
    if not isinstance(s, NamedSharding):
        raise ConfigError(f"{what} sharding {s!r} is not supported (use a NamedSharding)")
    return s


def transfer(x, dst_sharding: NamedSharding):
    """`x` placed with `dst_sharding`; the result on processes owning destination devices, else None.

    x: a jax.Array, or on a process without source devices a ShapeDtypeStruct carrying the source sharding.
    Same-process moves are a plain `jax.device_put`. Across processes the source and destination meshes
    must have the same shape and the PartitionSpec is kept (reshard on either side first otherwise).
    """
    shape, dtype = tuple(x.shape), x.dtype
    src = _as_named(x.sharding, "source")
    dst = _as_named(dst_sharding, "destination")
    me = jax.process_index()
    src_procs = {d.process_index for d in src.mesh.devices.flat}
    dst_procs = {d.process_index for d in dst.mesh.devices.flat}
    if src_procs == dst_procs == {me}:
        return jax.device_put(x, dst)
    if src.mesh.devices.shape != dst.mesh.devices.shape or src.spec != dst.spec:
        raise ConfigError(
            f"cross-process transfer needs equal mesh shapes and specs; got source {src.mesh.devices.shape} "
            f"{src.spec} and destination {dst.mesh.devices.shape} {dst.spec}")
    if set(src.mesh.devices.flat) & set(dst.mesh.devices.flat):
        raise ConfigError("cross-process transfer needs disjoint source and destination devices")
    if me not in src_procs | dst_procs:
        raise ConfigError(f"process {me} owns none of the transfer's devices and must not call transfer()")
    both, full, fn = _pair_fn(src.mesh, dst.mesh, src.spec)
    block = src.shard_shape(shape)
    local = {}
    if me in src_procs:
        if not isinstance(x, jax.Array):
            raise ConfigError(f"process {me} owns source devices, so it must pass the array, not {type(x).__name__}")
        for s in x.addressable_shards:
            local[s.device] = s.data[None]
    for d in dst.mesh.devices.flat:
        if d.process_index == me:
            local[d] = _zeros(d, (1,) + block, np.dtype(dtype))
    arrays = [local[d] for d in full.addressable_devices_indices_map((2,) + shape)]
    stacked = jax.make_array_from_single_device_arrays((2,) + shape, full, arrays)
    moved = fn(stacked)
    if me not in dst_procs:
        return None
    dst_dev = set(dst.mesh.devices.flat)
    mine = [s.data[0] for s in moved.addressable_shards if s.device in dst_dev]
    # shard_map output shards live on the same devices as dst's, so this is a re-labelling, not a copy
    return jax.make_array_from_single_device_arrays(shape, dst, mine)
