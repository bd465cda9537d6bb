"""How long one pipeline pass takes under each schedule: the theory with equal stage times, and the same formulas
with each stage's own F, B and W times (what the planner prices a pipeline by).

With per-stage seconds per micro-batch ``f_i`` (forward), ``b_i`` (input gradient) and ``w_i`` (weight gradient),
``s_i = f_i + b_i + w_i`` and ``k`` the busiest stage (largest ``s_k``), a pass of ``m`` micro-batches takes
``m * s_k`` plus the busiest stage's idle time (its *bubble*):

=============  =======================================  ===================================================
schedule       idle of the busiest stage                 equal times (p stages, F = B = W)
=============  =======================================  ===================================================
GPipe, 1F1B    sum_{i != k} s_i                          (p-1)(F+B+W): (p-1)/(m+p-1) of the pass
interleaved    sum_{i != k} s_i / v                      (p-1)(F+B+W)/v (m a multiple of p)
ZB-H1          sum_{i != k} max(f_i + b_i - w_k, f_i)    (p-1) max(F+B-W, F): a third of 1F1B's
ZB-V           half of ZB-H1's                           (p-1) max(F+B-W, F)/2: a sixth of 1F1B's
=============  =======================================  ===================================================

1F1B's is the planner's sum of the stage times plus (m-1) times the slowest (`pipeline_time`). Interleaving v
virtual stages per stage divides the fill and drain by v (Megatron-LM). ZB-H1 (1F1B's memory) fills what 1F1B
leaves idle with deferred weight gradients: the busiest stage waits for the forward of the first micro-batch and
the input gradient coming back, less one W per other stage, and never less than the forward (the last stage
cannot start before the first forward reaches it). ZB-V runs two half-size virtual stages per stage in a V, so
its fill and drain are half of ZB-H1's. These are the figures with equal times that the generated schedules are
tested against (`tests/test_schedules.py`); with unequal stages the event simulation (`cfp.schedules.simulate`) of
the generated schedule is the figure to trust, and the planner's explanation shows both.
"""
from __future__ import annotations

from typing import Sequence, Union


def pipeline_time(stage_seconds: Sequence[float], microbatches: Union[Sequence[float], int]) -> float:
    """Seconds of one pipeline pass under a non-interleaved schedule (GPipe, 1F1B): the longest path through the
    stage x micro-batch grid whose cell (i, j) takes ``stage_seconds[i] * w[j]``, taken as

        sum_i s_i * max w  +  sum_j w_j * max s  -  max s * max w

    -- exact when every micro-batch costs alike (``microbatches`` an int c, w = 1: the planner's sum of the stage
    times plus (c-1) times the slowest, FlashFlex/HexiScale) or every stage does (``stage_seconds`` all 1, w the
    micro-batch costs: Hydraulis' sum of the micro-batches plus (pp-1) times the slowest)."""
    if not stage_seconds:
        return 0.0
    if isinstance(microbatches, int):
        w_sum, w_max = float(microbatches), 1.0
    else:
        if len(microbatches) == 0:
            return 0.0
        w_sum, w_max = float(sum(microbatches)), float(max(microbatches))
    s_max = max(stage_seconds)
    return sum(stage_seconds) * w_max + (w_sum - w_max) * s_max


def _busiest(f, b, w) -> tuple[list[float], int]:
    s = [x + y + z for x, y, z in zip(f, b, w)]
    return s, max(range(len(s)), key=lambda i: (s[i], -i))


def one_f_one_b_seconds(f: Sequence[float], b: Sequence[float], w: Sequence[float], m: int, v: int = 1) -> float:
    """GPipe or 1F1B (a whole backward of ``b + w``)."""
    s, _ = _busiest(f, b, w)
    return pipeline_time(s, m) if s else 0.0


def interleaved_seconds(f: Sequence[float], b: Sequence[float], w: Sequence[float], m: int, v: int = 2) -> float:
    """Interleaved 1F1B with ``v`` virtual stages per stage (a whole backward)."""
    if not f:
        return 0.0
    s, k = _busiest(f, b, w)
    return m * s[k] + (sum(s) - s[k]) / v


def zb_h1_seconds(f: Sequence[float], b: Sequence[float], w: Sequence[float], m: int, v: int = 1) -> float:
    """ZB-H1: B and W split, W deferred to fill what 1F1B leaves idle, at 1F1B's memory."""
    if not f:
        return 0.0
    s, k = _busiest(f, b, w)
    return m * s[k] + sum(max(f[i] + b[i] - w[k], f[i]) for i in range(len(s)) if i != k)


def zb_v_seconds(f: Sequence[float], b: Sequence[float], w: Sequence[float], m: int, v: int = 2) -> float:
    """ZB-V: two half-size virtual stages per stage in a V, B and W split."""
    if not f:
        return 0.0
    s, k = _busiest(f, b, w)
    return m * s[k] + sum(max(f[i] + b[i] - w[k], f[i]) for i in range(len(s)) if i != k) / 2


def theory(seconds, p: int, m: int, v: int, fwd: float, bwd_input: float, bwd_weight: float) -> float:
    """One of the formulas above with ``p`` equal stages."""
    return seconds([fwd] * p, [bwd_input] * p, [bwd_weight] * p, m, v)


def bubble_of(makespan: float, m: int, busiest_seconds: float) -> float:
    """Fraction of ``makespan`` the busiest stage (``busiest_seconds`` per micro-batch) is idle."""
    return 1.0 - m * busiest_seconds / makespan if makespan > 0 else 0.0
