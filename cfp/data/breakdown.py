"""Where a variable-length step's time goes, per pipeline: measured from the step's timeline, the compute split
by the scheme's fitted costs.

For pipeline p of a step that took `host` seconds to assign and lay out plus `seconds` in the engine (the
events' times count from the engine step's start):

    host    assignment + layout before the engine step, and the engine's lead-in before p's first action
            (checking and placing the micro-batches, dispatching the first action)       measured
    compute the mean over p's stages of their busy time (the union of their events)      measured
    bubble  p's span (first action's start to last action's end) - compute                 measured
    idle    the slowest pipeline's last end - p's last end: waiting for it                  measured
    sync    the step's end - the slowest pipeline's last end: gradient sync and update    measured
and they sum to host + seconds. Compute is split over each micro-batch's share of it (its events' durations)
by the scheme's fitted cost of its layout (`cfp.data.schemes`, form ROWS): a·score entries + b·token slots + c,
each part counted as
    real      entries inside a sequence's own causal block, and real token slots
    padding   padded slots (bucket rounding and padding rows) and the entries of padded queries
    cross     entries of real queries outside their sequence's causal block that the attention computes: the
              masked parts of the blocks it computes (other sequences sharing a block, the diagonal blocks'
              upper halves)
    overhead  the fitted per-micro-batch constant c
so each part is measured time attributed by the fits' shares (said so wherever printed).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from cfp.data.rows import arrange, layout_entries, own_pairs
from cfp.data.schemes import CostForm, Scheme

PARTS = ("host", "real", "padding", "cross", "overhead", "bubble", "idle", "sync")
LABELS = {"host": "host assign+dispatch", "real": "real tokens", "padding": "padding", "cross": "cross-sequence attn",
          "overhead": "per-micro-batch", "bubble": "bubble", "idle": "idle (slowest pipeline)",
          "sync": "grad sync+update"}


@dataclasses.dataclass(frozen=True)
class PipelineTime:
    """One pipeline's step, in seconds (`PARTS`, summing to the step's time), with the assignment's estimate
    of its span (first action's start to last action's end) next to the measured span."""
    pipeline: int
    devices: int
    host: float
    real: float
    padding: float
    cross: float
    overhead: float
    bubble: float
    idle: float
    sync: float
    span: float
    estimated_span: float

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in PARTS)


def compute_parts(lengths: Sequence[int], packed: bool, dense: bool = False) -> dict[str, float]:
    """A micro-batch's score entries and token slots as the runtime computes them (per head and layer; `dense`:
    a context-parallel stage's ring attention): {own, pad_entries, cross, real_slots, pad_slots}."""
    lay = arrange(lengths, packed)
    lengths = [int(s) for s in lengths]
    total, pad_entries = layout_entries(lay, lengths, dense)
    own = own_pairs(lengths)
    real = sum(lengths)
    return {"own": own, "pad_entries": pad_entries, "cross": total - own - pad_entries, "real_slots": real,
            "pad_slots": lay.slots - real}


def micro_batch_shares(scheme: Scheme, lengths: Sequence[int], packed: bool) -> dict[str, float]:
    """Fractions {real, padding, cross, overhead} of a micro-batch's time by the scheme's fitted cost of its
    rows; a scheme not fitted to this runtime (VARLEN) splits by token slots alone."""
    p = compute_parts(lengths, packed, scheme.cp > 1)
    if scheme.form is not CostForm.ROWS or scheme.a + scheme.b + scheme.c == 0:
        total = p["real_slots"] + p["pad_slots"]
        return {"real": p["real_slots"] / total, "padding": p["pad_slots"] / total, "cross": 0.0, "overhead": 0.0}
    a, b = scheme.a, scheme.b
    parts = {"real": a * p["own"] + b * p["real_slots"], "padding": a * p["pad_entries"] + b * p["pad_slots"],
             "cross": a * p["cross"], "overhead": scheme.c}
    total = sum(parts.values())
    return {k: v / total for k, v in parts.items()}


def _lag(seconds: float) -> float:
    """A remainder of two clocks, at least 0: a watcher thread stamps an action's end when it wakes, which on a
    loaded host can be after the step's own clock stopped (or after the next action's start), so a remainder
    can come out a little below 0; that is the stamps' lag, not time the step spent."""
    return max(0.0, seconds)


def step_breakdown(events, seconds: float, host: float, pipes: Sequence[Scheme], plan, lengths,
                   packed: bool, estimates: Sequence[float]) -> list[PipelineTime]:
    """Per pipeline of the step (`pipes[p]` ran `plan[p]`, micro-batches as indices into `lengths`) its
    `PipelineTime`; `estimates[p]` the assignment's estimate of its span. Pipelines without micro-batches
    are idle for the whole engine step."""
    lengths = np.asarray(lengths, np.int64)
    ends = [e.end for e in events]
    last = max(ends) if ends else 0.0
    out = []
    for p, (scheme, mbs) in enumerate(zip(pipes, plan)):
        mine = [e for e in events if e.pipeline == p]
        if not mine:
            out.append(PipelineTime(pipeline=p, devices=scheme.devices, host=host, real=0.0, padding=0.0,
                                    cross=0.0, overhead=0.0, bubble=0.0, idle=last, sync=_lag(seconds - last), span=0.0,
                                    estimated_span=float(estimates[p])))
            continue
        stages = max(e.stage for e in mine) + 1
        start, end = min(e.start for e in mine), max(e.end for e in mine)
        per_mb = np.zeros(len(mbs))
        for e in mine:
            per_mb[e.microbatch] += (e.end - e.start) / stages
        parts = dict.fromkeys(("real", "padding", "cross", "overhead"), 0.0)
        for m, mb in enumerate(mbs):
            for k, f in micro_batch_shares(scheme, lengths[mb].tolist(), packed).items():
                parts[k] += f * per_mb[m]
        out.append(PipelineTime(pipeline=p, devices=scheme.devices, host=host + start,
                                bubble=_lag((end - start) - per_mb.sum()), idle=last - end, sync=_lag(seconds - last),
                                span=end - start, estimated_span=float(estimates[p]), **parts))
    return out


def step_summary(times: Sequence[PipelineTime]) -> dict[str, float]:
    """The step's parts as device-weighted means over its pipelines (each sums to the step's time)."""
    w = np.array([t.devices for t in times], np.float64)
    return {k: float(np.dot(w, [getattr(t, k) for t in times]) / w.sum()) for k in PARTS}


def format_summary(parts: dict[str, float]) -> str:
    total = sum(parts[k] for k in PARTS)
    return " | ".join(f"{LABELS[k]} {100 * parts[k] / total:.0f}%" for k in PARTS) + f" of {total:.3f} s"


def format_pipeline(t: PipelineTime) -> str:
    parts = "  ".join(f"{k} {getattr(t, k):.3f}" for k in PARTS)
    err = f"{100 * (t.estimated_span / t.span - 1):+.0f}%" if t.span > 0 else "n/a"
    return (f"pipeline {t.pipeline}: {parts} s; span measured {t.span:.3f} s, estimated {t.estimated_span:.3f} s "
            f"({err})")
