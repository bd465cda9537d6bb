"""What a compiled XLA program tells: per-device memory, cost analysis, and its measured wall time.

The one home for these measurements; the sharding, profiling, search and baseline passes all read compiled
programs through it.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import jax

from cfp.xla.hlo import Collective, parse_collectives


def device_kind() -> str:
    """`platform:device_kind` of the first local device (part of the profile cache key)."""
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


def compiled_memory(compiled, donated: bool = False) -> int:
    """Per-device bytes of a compiled program: arguments + outputs + temporaries (`memory_analysis()`); with
    `donated`, less the outputs XLA aliased to donated arguments (counted once, not as argument and output)."""
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return int(total - m.alias_size_in_bytes if donated else total)


def compiled_cost(compiled) -> dict:
    """`cost_analysis()` as one dict (some backends return a list with one per program)."""
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return cost


def time_compiled(compiled, args, iters: int, warmup: int, before_timing: Callable | None = None) -> float:
    """Median wall seconds of `compiled(*args)` over `iters` runs after `warmup` runs (and `before_timing()`)."""
    return time_compiled_spread(compiled, args, iters, warmup, before_timing)[0]


def time_compiled_spread(compiled, args, iters: int, warmup: int,
                         before_timing: Callable | None = None) -> tuple[float, float]:
    """(median wall seconds, relative noise) of `compiled(*args)`; the noise is half the range of the timed
    runs over the median, the ± within which two medians are not told apart."""
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    if before_timing is not None:
        before_timing()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return _median_noise(times)


def time_interleaved(runs: Sequence[tuple[object, Callable[[], Sequence]]], rounds: int,
                     warmup: int, budget: float | None = None, min_rounds: int = 3) -> list[tuple[float, float]]:
    """(median wall seconds, relative noise) of each `(compiled, make_args)` in `runs`, timed in turns (see
    `time_in_turns`, also for `budget`). Each program's arguments are made (placed) just before its run and
    dropped after, so only one program's arguments live at a time."""
    def prepare(compiled, make_args):
        args = make_args()
        jax.block_until_ready(args)
        return lambda: compiled(*args)
    return time_in_turns([lambda c=c, m=m: prepare(c, m) for c, m in runs], rounds, warmup, budget, min_rounds)


def time_in_turns(prepares: Sequence[Callable[[], Callable[[], object]]], rounds: int,
                  warmup: int, budget: float | None = None, min_rounds: int = 3) -> list[tuple[float, float]]:
    """(median wall seconds, relative noise) of each run, timed in turn within each of `rounds` rounds, so
    that a burst of load on a shared host falls on all of them alike rather than on whichever was being timed
    alone. `prepares[k]()` (not timed) returns the function to time, whose result is waited for; noise as in
    `time_compiled_spread`. With `budget` (seconds), rounds past the first `min_rounds` stop once the timed
    runs have taken that long: a slow program (a deep model's step) is timed fewer times, not for longer."""
    for prepare in prepares:
        fn = prepare()
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in prepares]
    for r in range(rounds):
        spent = sum(map(sum, times))
        if budget is not None and r >= min_rounds and spent + spent / r > budget:
            break
        for k, prepare in enumerate(prepares):
            fn = prepare()
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
            del fn
    return [_median_noise(ts) for ts in times]


def _median_noise(times: Sequence[float]) -> tuple[float, float]:
    """Median and half the range over the median: the ± within which two medians are not told apart."""
    med = statistics.median(times)
    return med, ((max(times) - min(times)) / 2 / med if med > 0 else 0.0)


@dataclasses.dataclass(frozen=True)
class CompiledFigures:
    """Per-device figures of one compiled program, read from XLA (nothing is run)."""

    memory: int                             # bytes: arguments + outputs + temporaries
    flops: float                            # `cost_analysis()` FLOPs
    bytes_accessed: float                   # `cost_analysis()` bytes accessed
    collectives: tuple[Collective, ...]     # parsed from the partitioned HLO (empty unless asked for)


def compiled_figures(compiled, mesh_shape: Sequence[int], collectives: bool = True) -> CompiledFigures:
    """Memory, cost and (with `collectives`) the collectives of `compiled` on a mesh of `mesh_shape`."""
    cost = compiled_cost(compiled)
    found = parse_collectives(compiled.as_text(), tuple(mesh_shape)) if collectives else ()
    return CompiledFigures(compiled_memory(compiled), float(cost.get("flops", 0.0)),
                           float(cost.get("bytes accessed", 0.0)), found)
