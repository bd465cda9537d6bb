"""Per-scheme corrections of the fitted costs from the measured spans of the pipelines that ran (`cfp data train`).

The fits time one pipeline of a scheme alone on packed rows; in a step the pipelines share the devices and run
other row shapes, so one scheme's pipelines can run steadily slower than priced and another's faster, and the
per-step choice then ranks the mixes wrongly (measured on 8 CPU devices: 4x(1,2,1) pipelines at 0.84 of their
estimated span, a mix of (1,1,1) and (1,2,1) pipelines at 1.11; the choice passed over the latter, which ran
1.1x faster). After each step every scheme that ran moves its factor halfway, in log scale, toward the median
measured / estimated span of its pipelines; the next step prices each candidate with its schemes' costs scaled by
their factors. A scheme no chosen mix uses keeps its fit: the choice learns only from what it runs."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from cfp.data.breakdown import PipelineTime
from cfp.data.schemes import Scheme, Shape

DAMPING = 0.5                  # the share of a step's log ratio a factor takes: one noisy step moves it half-way
BOUNDS = (0.25, 4.0)           # a factor never prices a scheme beyond 4x either way of its fit


def scaled(candidates: Sequence[Sequence[Scheme]], factors: Mapping[Shape, float]) -> list[list[Scheme]]:
    """The candidates with each scheme's fitted a, b and c multiplied by its factor (1 where it has none)."""
    def one(s: Scheme) -> Scheme:
        f = factors.get(s.shape, 1.0)
        return s if f == 1.0 else dataclasses.replace(s, a=s.a * f, b=s.b * f, c=s.c * f)
    return [[one(s) for s in mix] for mix in candidates]


def updated(factors: Mapping[Shape, float], pipes: Sequence[Scheme], times: Sequence[PipelineTime]
            ) -> dict[Shape, float]:
    """`factors` after a step that ran `pipes` (its mix) with measured `times` (one per pipeline, in order,
    estimated from the scaled schemes): pipelines that computed nothing are left out."""
    ratios: dict[Shape, list[float]] = {}
    for s, t in zip(pipes, times):
        if t.span > 0 and t.estimated_span > 0 and np.isfinite(t.span / t.estimated_span):
            ratios.setdefault(s.shape, []).append(t.span / t.estimated_span)
    out = dict(factors)
    for k, r in ratios.items():
        f = out.get(k, 1.0) * float(np.median(r)) ** DAMPING
        out[k] = float(np.clip(f, *BOUNDS))
    return out
