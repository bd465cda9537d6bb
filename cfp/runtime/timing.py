"""Measured start/end times of a step's dispatched stage computations.

JAX dispatches asynchronously, so one watcher thread per stage waits on each dispatched computation
and records when it finished.  An action's start is the latest of its dispatch, its stage's previous
action's end and its producer's end (the previous stage's forward, or the next stage's backward and
its own forward); an end observed before that start (watcher threads poll independently) is raised to it.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import jax

from cfp.runtime.schedules import Phase
from cfp.runtime.timeline import Event


class _Watcher:
    """Waits, in a thread, for a stage's computations to finish and records their end times."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.ends: dict[tuple, float] = {}
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            key, arr = self.q.get()
            try:
                jax.block_until_ready(arr)
            finally:
                self.ends[key] = time.perf_counter()
                self.q.task_done()


_WATCHERS: dict[tuple[int, ...], _Watcher] = {}


def _watcher(devices: tuple[int, ...]) -> _Watcher:
    """One watcher thread per device group, shared by the trainers of a process (used in turn)."""
    if devices not in _WATCHERS:
        _WATCHERS[devices] = _Watcher()
    return _WATCHERS[devices]


class StepClock:
    """Dispatch times and watched end times of one step's actions on this process's stages."""

    def __init__(self, local_stages: dict[tuple[int, int], tuple[int, ...]]):
        """``local_stages``: stage key -> its device ids, for the stages this process runs."""
        self._watchers = {key: _watcher(devs) for key, devs in local_stages.items()}
        self._dispatched: dict[tuple, float] = {}

    def dispatched(self, key: tuple[int, int], microbatch: int, phase: Phase, t0: float,
                   done: Any) -> None:
        """Record that the action was dispatched at ``t0``; ``done`` becomes ready when it ends."""
        self._dispatched[(key, microbatch, phase)] = t0
        self._watchers[key].q.put(((microbatch, phase), done))

    def events(self, order: list, t_start: float) -> list[Event]:
        """Wait for every watched action and return its Event, times relative to ``t_start``."""
        ends = self._collect_ends()
        dispatched, self._dispatched = self._dispatched, {}
        events, last_end = [], {}
        for a in order:
            key = (a.pipeline, a.stage)
            k = (key, a.microbatch, a.phase)
            if k not in ends:  # another process's stage
                continue
            deps = [last_end.get(key, t_start), dispatched[k]]
            if a.phase is Phase.FWD:
                deps.append(ends.get(((a.pipeline, a.stage - 1), a.microbatch, Phase.FWD), t_start))
            else:
                deps.append(ends.get(((a.pipeline, a.stage + 1), a.microbatch, Phase.BWD), t_start))
                deps.append(ends.get((key, a.microbatch, Phase.FWD), t_start))
            start = max(deps)
            # watchers of different stages poll independently, so one may see a consumer finish a little
            # before another records its producer's end: an action cannot end before it can start
            ends[k] = max(ends[k], start)
            last_end[key] = ends[k]
            events.append(Event(a.pipeline, a.stage, a.microbatch, a.phase, start - t_start,
                                ends[k] - t_start))
        return events

    def _collect_ends(self) -> dict[tuple, float]:
        for w in self._watchers.values():
            w.q.join()
        ends = {(key, m, ph): t for key, w in self._watchers.items() for (m, ph), t in w.ends.items()}
        for w in self._watchers.values():
            w.ends.clear()
        return ends
