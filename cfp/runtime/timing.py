"""Measured start/end times of a step's dispatched stage computations.

JAX dispatches asynchronously, so one watcher thread per stage waits, in dispatch order, first on the
outputs of an action's producers (the previous stage's forward; the next stage's backward and its own
forward), then on the action's own outputs, taking the time after each wait. An action's end is the earliest
moment any thread saw its outputs ready (its own, or a consumer's waiting on them as inputs); its start is
the latest of the measured instants it waited for: its dispatch, its producers' ends and the end of its
stage's previous action (XLA runs it as soon as all three hold). A consumer so never starts before its
producer ends, nothing is clamped, and an action whose measured end is not after its start (the watchers
fell behind) is left out and its stage listed in `StepClock.unmeasured`.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import jax

from cfp.runtime.timeline import Event
from cfp.schedules.registry import Phase


class _Watcher:
    """Waits, in a thread, for a stage's computations to finish and records their observed intervals."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.spans: dict[tuple, tuple[float, float] | None] = {}
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            key, inputs, arr = self.q.get()
            span = None
            try:
                jax.block_until_ready(inputs)
                seen = time.perf_counter()
                jax.block_until_ready(arr)
                span = (seen, time.perf_counter())
            finally:
                self.spans[key] = span
                self.q.task_done()


_WATCHERS: dict[tuple[int, ...], _Watcher] = {}


def _watcher(devices: tuple[int, ...]) -> _Watcher:
    """One watcher thread per device group, shared by the trainers of a process (used in turn)."""
    if devices not in _WATCHERS:
        _WATCHERS[devices] = _Watcher()
    return _WATCHERS[devices]


class StepClock:
    """Dispatch times and watched intervals of one step's actions on this process's stages."""

    def __init__(self, local_stages: dict[tuple[int, int], tuple[int, ...]]):
        """``local_stages``: stage key -> its device ids, for the stages this process runs (expanded stages of
        one stage share its devices: an action's start is also after the previous action on those devices)."""
        self._watchers = {key: _watcher(devs) for key, devs in local_stages.items()}
        self._devices = dict(local_stages)   # stages on the same devices (virtual stages) run one at a time
        self._done: dict[tuple, tuple[Any, int]] = {}     # outputs and how many local consumers still need them
        self._dispatched: dict[tuple, float] = {}
        self._alone: dict[tuple, float] = {}     # when an action timed alone ended (serial passes)
        self._inputs: dict[tuple, list[tuple]] = {}
        self.unmeasured: list[tuple[int, int]] = []    # per action of the last `events` with no measured
        # interval, its stage

    def dispatched(self, key: tuple[int, int], microbatch: int, phase: Phase, t0: float,
                   done: Any) -> None:
        """Record that the action was dispatched at ``t0``; ``done`` becomes ready when it ends."""
        pipeline, stage = key
        if phase is Phase.FWD:
            producers = [((pipeline, stage - 1), microbatch, Phase.FWD)]
            consumers = int((pipeline, stage + 1) in self._watchers) + 1     # the next stage's fwd, own bwd
        elif phase is Phase.BWD_WEIGHT:
            producers, consumers = [(key, microbatch, Phase.BWD_INPUT)], 0
        else:                            # the whole backward, or B (whose W is one more consumer)
            producers = [((pipeline, stage + 1), microbatch, phase), (key, microbatch, Phase.FWD)]
            consumers = int((pipeline, stage - 1) in self._watchers) + int(phase is Phase.BWD_INPUT)
        k = (key, microbatch, phase)
        self._inputs[k] = [p for p in producers if p in self._done]     # another process's: not watched here
        self._dispatched[k] = t0
        self._watchers[key].q.put((k, [self._done[p][0] for p in self._inputs[k]], done))
        for p in self._inputs[k]:       # hold a producer's outputs only until its last local consumer has them
            arr, left = self._done.pop(p)
            if left > 1:
                self._done[p] = (arr, left - 1)
        if consumers:
            self._done[k] = (done, consumers)

    def alone(self, key: tuple[int, int], microbatch: int, phase: Phase, end: float) -> None:
        """The action ran alone (a serial pass: dispatched after the one before it ended) and the dispatching
        thread, waiting for it, saw it end at ``end``: its event spans its dispatch to then (its watcher, waking
        later, would lengthen it)."""
        self._alone[(key, microbatch, phase)] = end

    def events(self, order: list, t_start: float) -> list[Event]:
        """Wait for every watched action and return the Events of those measured, relative to ``t_start``."""
        spans = self._collect()
        # an action's outputs were ready no later than any thread saw them: its own, or a consumer's
        ends = {k: v[1] for k, v in spans.items() if v is not None}
        for k, v in spans.items():
            for p in self._inputs.get(k, ()):
                if v is not None and p in ends:
                    ends[p] = min(ends[p], v[0])
        dispatched, inputs = self._dispatched, self._inputs
        alone = self._alone
        self._done, self._dispatched, self._inputs, self._alone = {}, {}, {}, {}
        events, self.unmeasured, last_end = [], [], {}
        for a in order:
            key = (a.pipeline, a.stage)
            k = (key, a.microbatch, a.phase)
            if k not in spans:  # another process's stage
                continue
            if k in alone:      # timed alone: from its dispatch to its end
                events.append(Event(a.pipeline, a.stage, a.microbatch, a.phase, dispatched[k] - t_start,
                                    alone[k] - t_start))
                continue
            if k not in ends:
                self.unmeasured.append(key)
                continue
            devs = self._devices[key]
            start = max([dispatched[k], last_end.get(devs, dispatched[k])]
                        + [ends[p] for p in inputs[k] if p in ends])
            last_end[devs] = ends[k]
            if not ends[k] > start:
                self.unmeasured.append(key)
                continue
            events.append(Event(a.pipeline, a.stage, a.microbatch, a.phase, start - t_start, ends[k] - t_start))
        return events

    def _collect(self) -> dict[tuple, tuple[float, float] | None]:
        watchers = {id(w): w for w in self._watchers.values()}.values()   # stages on the same devices share one
        for w in watchers:
            w.q.join()
        spans = {k: v for w in watchers for k, v in w.spans.items()}
        for w in watchers:
            w.spans.clear()
        return spans
