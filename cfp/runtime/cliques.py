"""The processes of a clique (devices in a collective's order) meet before the first collective on it.

Why: XLA's CPU collectives (gloo, cross-process) build one connection context per clique -- the list of devices
in the order the collective's mesh gives them: a move from device 2 to 2048 and one from 2048 to 2 are two -- the
first time a collective runs on it, and that rendezvous reads the peers' addresses from the coordination service
with a fixed 30 s deadline (XLA's ``GlooKeyValueStore``; neither ``jax.distributed.initialize`` nor the XLA flags
set it). A process that reaches a clique's first collective more than 30 s before a peer -- the peer still
compiling its own stages, which on a loaded host with each rank bound to one core takes that long -- fails with
"Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out", and the peer then aborts
("JAX distributed service detected fatal errors") or sees "Connection reset by peer" (issue 41). Once a context
exists, a collective waits for a late peer for XLA's 30 minutes. So before a clique's first collective its
processes wait at a barrier of the coordination service, with a timeout of cfp's own (`MEET_TIMEOUT_S`); after
it they enter the collective within moments of each other.

Every process runs the same collectives in the same order (`cfp.runtime.comm`), so the processes of a clique
agree on which collective is its first, and they meet there.
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import jax

from cfp.errors import CfpError

# The longest one process may wait at a clique's first collective for the others: compile skew on a loaded host
# (minutes at worst). A dead peer ends the wait sooner: the coordination service fails the barrier once the
# peer's heartbeat times out.
MEET_TIMEOUT_S = 600

_met: set[tuple[int, ...]] = set()
_lock = threading.Lock()


def meet_before_first_collective(devices: Sequence[Any], ready: Optional[Any] = None) -> bool:
    """Wait until every process holding one of ``devices`` (in the collective's mesh order) gets here, the first
    time this process runs a collective on them in that order; later calls (and devices of one process) return at
    once. ``ready``: the arrays this process's collective reads, waited for first so that work queued before it
    does not delay its start. Returns whether it waited at a barrier."""
    processes = sorted({d.process_index for d in devices})
    if len(processes) < 2:
        return False
    ids = tuple(d.id for d in devices)      # in order: gloo keys its contexts by the ordered list
    with _lock:
        if ids in _met:
            return False
        _met.add(ids)
    if ready is not None:
        jax.block_until_ready(ready)
    from cfp.ir._jax_internals import distributed_client
    client = distributed_client()
    if client is None:
        raise CfpError(f"devices {list(ids)} span processes {processes} but jax.distributed is not initialized "
                       "(call cfp.runtime.launch.maybe_initialize_distributed first)")
    barrier = "cfp-first-collective:" + ",".join(map(str, ids))
    try:
        client.wait_at_barrier(barrier, MEET_TIMEOUT_S * 1000, processes)
    except jax.errors.JaxRuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CfpError(f"process {jax.process_index()}: processes {processes} did not all reach the first "
                       f"collective on devices {list(ids)} within {MEET_TIMEOUT_S} s (did another process die?): "
                       f"{first[:300]}") from None
    return True
