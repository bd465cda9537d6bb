"""Atomic training checkpoints on orbax-checkpoint.

Layout: ``<directory>/<step>/`` holding an orbax composite of ``state`` (the pytree, host numpy copies) and
``metadata`` (JSON). Atomicity comes from orbax: it writes into ``<step>.orbax-checkpoint-tmp-*`` and only
renames it to ``<step>`` after ``commit_success.txt`` is written, so a crash mid-write leaves a tmp dir that
:func:`latest_step` ignores (and the next save deletes). Retention (``keep``) is orbax's own: a
``CheckpointManager`` with a ``LatestN`` preservation policy, whose deleter first renames an old step into
``<directory>/.cfp-deleting/`` (``todelete_subdir``), so a crash while pruning never leaves a half-deleted
``<step>`` either; the next save empties that folder.

State is saved as host numpy arrays, so a checkpoint does not remember its shardings and can be restored
onto any mesh (restore gives numpy; ``jax.device_put`` it onto the new shardings).

Integrity: every checkpoint carries a SHA-256 checksum of each leaf (dtype, shape and bytes) as a third item,
``checksums``; restore recomputes them and refuses a checkpoint whose data do not match, or that cannot be
read at all (a truncated chunk or metadata file), with a one-line ``ConfigError`` naming the step and leaf.

Multi-process: each call is process-local (no cross-process barriers). Give each process its own directory
(e.g. ``f"{dir}/proc{jax.process_index()}"``) for the state its devices hold, or gather with
``jax.experimental.multihost_utils.process_allgather`` and save on process 0 only.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
from typing import Any, Callable

import jax
import numpy as np

from cfp.errors import ConfigError

COMMIT_FILE = "commit_success.txt"  # written by orbax just before the final rename
_TMP_MARK = ".orbax-checkpoint-tmp"
_RETIRED = ".cfp-deleting"  # a retired step: renamed first, then deleted


def _ocp():
    import orbax.checkpoint as ocp  # imported lazily: orbax is slow to import

    return ocp


@functools.lru_cache(maxsize=None)
def _local_numpy_registry():
    """Type registry whose numpy handler writes on the calling process.

    orbax's NumpyHandler treats numpy leaves as replicated and writes them only on process 0, and its
    ArrayHandler refuses process-local jax.Arrays in multi-process runs; so without this a process-local
    checkpoint of process 1 would silently lack its arrays. The override is orbax's own write loop
    (orbax-checkpoint 0.12) minus the `process_index() == 0` test.
    """
    import asyncio

    from orbax.checkpoint._src.serialization import ocdbt_utils, type_handler_registry, type_handlers
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    ocp = _ocp()

    class LocalNumpyHandler(type_handlers.NumpyHandler):
        async def _background_serialize(self, values, infos, args=None):
            writes = []
            for value, info, arg in zip(values, infos, args):
                await info.await_path_creation()
                spec = ts_utils.build_array_write_spec(
                    info=info, arg=arg, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    process_index=ocdbt_utils.get_process_index_for_subdir(
                        use_ocdbt=info.is_ocdbt_checkpoint,
                        override_ocdbt_process_id=self._override_ocdbt_process_id),
                    metadata_key=self._metadata_key)
                writes.append(self._open_and_write(value, spec.json, info.ts_context))
            await asyncio.gather(*writes)

    return ocp.type_handlers.create_type_handler_registry(
        *type_handler_registry._DEFAULT_TYPE_HANDLERS, (np.ndarray, LocalNumpyHandler()))


def _multiprocessing_options():
    ocp = _ocp()
    pid = jax.process_index()
    # process-local: no barriers with other processes, which may save different state or not at all
    return ocp.options.MultiprocessingOptions(primary_host=pid, active_processes={pid},
                                              barrier_sync_key_prefix=f"cfp_ckpt_p{pid}")


def _item_handlers(mp) -> dict:
    # explicit item handlers: the ones orbax would create from the args default to primary_host=0, which
    # makes every other process skip writing (e.g. the JSON metadata)
    ocp = _ocp()
    return {"state": ocp.PyTreeCheckpointHandler(multiprocessing_options=mp,
                                                 type_handler_registry=_local_numpy_registry()),
            "metadata": ocp.JsonCheckpointHandler(multiprocessing_options=mp),
            "checksums": ocp.JsonCheckpointHandler(multiprocessing_options=mp)}


def _checkpointer():
    """A synchronous orbax Checkpointer of one step directory (what restore reads with)."""
    ocp = _ocp()
    mp = _multiprocessing_options()
    # directories created before the items write: orbax's default creates them in a background thread,
    # and under load the JSON metadata write once found its directory missing (a two-process test)
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(
            multiprocessing_options=mp,
            async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False)),
        **_item_handlers(mp))
    return ocp.Checkpointer(handler, multiprocessing_options=mp)


def _manager(directory: str, keep: int | None):
    """orbax's CheckpointManager of `directory`: synchronous saves, the newest `keep` steps kept (None: all),
    old steps renamed into `_RETIRED` before they are deleted."""
    ocp = _ocp()
    mp = _multiprocessing_options()
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
        enable_async_checkpointing=False, multiprocessing_options=mp, todelete_subdir=_RETIRED,
        save_root_metadata=False, lightweight_initialize=True, create=False)  # makedirs above
    return ocp.CheckpointManager(directory, item_handlers=_item_handlers(mp), options=options)


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path) or "<root>"


def _to_host(state: Any) -> Any:
    def leaf(path, x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise ConfigError(
                f"state leaf {_path_str(path)!r} spans devices of several processes; save each process's "
                "local state in its own directory, or gather it with multihost_utils.process_allgather first")
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map_with_path(leaf, state)


def checksums(host: Any) -> dict[str, str]:
    """``{leaf path: sha256 of its dtype, shape and bytes}`` of a tree of numpy arrays."""
    out = {}
    for path, v in jax.tree_util.tree_flatten_with_path(host)[0]:
        a = np.ascontiguousarray(v)
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
        out[_path_str(path)] = h.hexdigest()
    return out


def all_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in `directory`, ascending (tmp / partial / retired dirs ignored)."""
    d = os.fspath(directory)
    if not os.path.isdir(d):
        return []
    steps = []
    for name in os.listdir(d):
        if name.isdigit() and os.path.isfile(os.path.join(d, name, COMMIT_FILE)):
            steps.append(int(name))
    return sorted(steps)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    steps = all_steps(directory)
    return steps[-1] if steps else None


def _remove_leftovers(d: str) -> None:
    # tmp dirs of crashed saves, retired dirs of crashed prunes, and step dirs without their commit file
    # (orbax would count them as steps); safe because saves are synchronous and a directory belongs to
    # one process
    for name in os.listdir(d):
        path = os.path.join(d, name)
        if _TMP_MARK in name or _RETIRED in name or (
                name.isdigit() and os.path.isdir(path) and not os.path.isfile(os.path.join(path, COMMIT_FILE))):
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(directory: str | os.PathLike, step: int, state: Any, metadata: dict | None = None,
                    keep: int | None = None, overwrite: bool = False) -> str:
    """Atomically save `state` (pytree of arrays) and JSON `metadata` as checkpoint `step`; returns its path.

    keep: how many newest checkpoints to keep (None keeps all); older ones are pruned by orbax's retention.
    overwrite: replace an existing `step`.
    """
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"checkpoint step={step!r} is invalid (must be an integer >= 0)")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ConfigError(f"keep={keep!r} is invalid (must be a positive integer, or None to keep all)")
    metadata = dict(metadata or {})
    d = os.path.abspath(os.fspath(directory))
    os.makedirs(d, exist_ok=True)
    _remove_leftovers(d)
    final = os.path.join(d, str(int(step)))
    if os.path.exists(final):
        if not overwrite:
            raise ConfigError(f"checkpoint step {step} already exists in {d!r} (pass overwrite=True to replace it)")
        _retire(d, int(step))
    host = _to_host(state)
    ocp = _ocp()
    manager = _manager(d, keep)
    try:
        manager.save(int(step), force=True, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(host), metadata=ocp.args.JsonSave(metadata),
            checksums=ocp.args.JsonSave(checksums(host))))
    finally:
        manager.close()
    _remove_leftovers(d)   # the pruned steps orbax renamed into _RETIRED
    return final


def _retire(d: str, step: int) -> None:
    retired = os.path.join(d, f"{step}{_RETIRED}")
    os.replace(os.path.join(d, str(step)), retired)  # atomic: the step vanishes as a whole
    shutil.rmtree(retired, ignore_errors=True)


def _lookup(raw: Any, path) -> Any:
    node = raw
    for k in path:
        if hasattr(k, "key"):  # DictKey; orbax stores dict keys as strings
            key = k.key
            node = node[key] if key in node else node[str(key)]
        elif hasattr(k, "idx"):  # SequenceKey / FlattenedIndexKey
            node = node[k.idx]
        else:  # GetAttrKey: namedtuples / dataclasses are stored as dicts by field name
            node = node[k.name]
    return node


def _read(path: str) -> dict:
    ocp = _ocp()
    ckptr = _checkpointer()
    try:
        # read every leaf as numpy, whatever it was saved as and wherever its devices were
        tree = ckptr.metadata(path).item_metadata["state"].tree
        as_np = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return ckptr.restore(path, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(restore_args=as_np), metadata=ocp.args.JsonRestore(),
            checksums=ocp.args.JsonRestore()))
    finally:
        ckptr.close()


def _read_verified(d: str, step: int) -> tuple[Any, dict]:
    """(raw state, metadata) of checkpoint ``step`` after checking every leaf against its checksum."""
    path = os.path.join(d, str(step))
    if not os.path.isdir(os.path.join(path, "checksums")):
        raise ConfigError(f"checkpoint step {step} in {d!r} has no checksums (written by an older "
                          "cfp?), so its data cannot be verified")
    try:
        out = _read(path)
    except Exception as e:  # orbax/tensorstore/JSON/OS errors of a damaged checkpoint vary by cause
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"checkpoint step {step} in {d!r} cannot be read (corrupt or truncated?): "
                          f"{type(e).__name__}: {first}") from None
    raw = jax.tree.map(np.asarray, out["state"])
    want, got = dict(out["checksums"] or {}), checksums(raw)
    for leaf in sorted(set(want) | set(got)):
        if want.get(leaf) != got.get(leaf):
            raise ConfigError(f"checkpoint step {step} in {d!r} is corrupt: leaf {leaf!r} does not "
                              "match the checksum written with it")
    return raw, dict(out["metadata"] or {})


def restore_checkpoint(directory: str | os.PathLike, step: int | None = None, target: Any = None,
                       check_metadata: Callable[[dict], None] | None = None) -> tuple[Any, dict]:
    """(state, metadata) of checkpoint `step` (default: latest) as numpy arrays.

    target: a pytree (arrays or ShapeDtypeStructs) giving the structure to restore into; shapes are
    checked and dtypes cast to the target's. Without it, the saved nested dicts/lists come back.
    check_metadata: called with the metadata before the state is fitted to `target` (e.g. to refuse a
    checkpoint written with other settings before its shapes are compared).
    """
    d = os.path.abspath(os.fspath(directory))
    steps = all_steps(d)
    if step is None:
        if not steps:
            raise ConfigError(f"no complete checkpoint in {d!r}")
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"checkpoint step {step} not found in {d!r} (available: {steps})")
    raw, metadata = _read_verified(d, step)
    if check_metadata is not None:
        check_metadata(metadata)
    if target is None:
        return raw, metadata

    def leaf(path, t):
        try:
            v = np.asarray(_lookup(raw, path))
        except (KeyError, IndexError, TypeError):
            raise ConfigError(f"checkpoint step {step} in {d!r} has no leaf {_path_str(path)!r} "
                              "that the target expects") from None
        if tuple(v.shape) != tuple(np.shape(t)):
            raise ConfigError(f"checkpoint leaf {_path_str(path)!r} has shape {v.shape}, target expects "
                              f"{tuple(np.shape(t))}")
        dtype = getattr(t, "dtype", None)
        return v.astype(dtype) if dtype is not None and v.dtype != dtype else v

    return jax.tree_util.tree_map_with_path(leaf, target), metadata
