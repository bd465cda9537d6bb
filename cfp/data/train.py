"""`cfp data train`: variable-length training with a batching method on the training engine.

A *mix* is a list of pipelines, each a <CP,TP,PP> scheme with its fitted cost (`Scheme`); it runs as the
engine's layout `Layout.from_schemes` (pp stages of cp x tp devices per pipeline). Each step draws
sequences (shuffled, seeded by (seed, step)) until `tokens_per_step` real tokens, and for every candidate
mix assigns them with the batching method (cfp.data.batching: dispatch to pipelines, then packing into
micro-batches); the step runs the candidate whose fitted pipeline times (micro-batch costs + (pp-1) x the
slowest micro-batch, the bubble of GPipe and 1F1B alike) rate fastest -- Hydraulis' dynamic mixes -- on
`cfp.runtime.engine.HeteroTrainer`, switching its layout when the choice changes. Each scheme's fits are
rescaled by the measured spans of its pipelines in the steps before (`cfp.data.rescale`).
"""
from __future__ import annotations

import ast
import dataclasses
import os
import time
from typing import Callable, Optional, Sequence

import numpy as np

from cfp.data.batching import METHODS, Method, Packing, assign_step, materialize
from cfp.data.breakdown import (PARTS, PipelineTime, format_pipeline, format_summary, step_breakdown,
                                step_summary)
from cfp.data.rescale import scaled, updated
from cfp.data.dispatch import shared_spans
from cfp.data.packing import pipeline_time
from cfp.data.propose import SchemeMix, propose
from cfp.data.schemes import Scheme, SchemeSpace, Shape
from cfp.data.sources import Sequences
from cfp.errors import ConfigError, InfeasibleError
from cfp.models.attention_select import header_line
from cfp.models.configs import MoEConfig
from cfp.runtime import heap
from cfp.schedules.registry import ScheduleName, ScheduleSpec


@dataclasses.dataclass(frozen=True)
class DataTrainOptions:
    model: str
    method: Method
    steps: int
    tokens_per_step: int
    learning_rate: float = 1e-3
    seed: int = 0
    ilp_max_sequences: int = 0
    weight_decay: float = 0.01
    schedule: "ScheduleName | ScheduleSpec" = ScheduleName.ONE_F_ONE_B   # interleaved:V: a ScheduleSpec
    parallel_pipelines: float | None = None     # `SchemeSpace.parallel_pipelines` of the fits
    recalibrate: bool = True    # scale each scheme's fits by its pipelines' measured spans (`cfp.data.rescale`)

    def __post_init__(self):
        if self.method not in METHODS.values():
            raise ConfigError(f"method {self.method!r} is not a registered batching method")
        for f in ("steps", "tokens_per_step"):
            if getattr(self, f) < 1:
                raise ConfigError(f"{f}={getattr(self, f)!r} must be a positive integer")
        p = self.parallel_pipelines
        if p is not None and not (np.isfinite(p) and p >= 1):
            raise ConfigError(f"parallel_pipelines={p!r} must be a number >= 1 (or None)")
        if not (self.learning_rate > 0 and self.weight_decay >= 0):
            raise ConfigError(f"learning_rate={self.learning_rate!r} must be > 0 and weight_decay="
                              f"{self.weight_decay!r} >= 0")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step ran: the chosen mix, its sequences (indices into the data), the estimates and where
    its time went (per pipeline, `cfp.data.breakdown`)."""
    mix: int
    sequences: tuple[int, ...]
    estimates: tuple[float, ...]    # fitted step time of every candidate (inf: cannot hold the step)
    pipelines: tuple[PipelineTime, ...] = ()
    plan: tuple = ()                # per pipeline its micro-batches, as indices into `sequences`
    micro_batches: int = 0
    loss: float = float("nan")
    real_tokens: int = 0
    slots: int = 0
    seconds: float = 0.0            # measured: host assignment + layout + the engine step
    cpu_seconds: float = 0.0        # measured: this process's CPU seconds (all threads) over those same parts

    def summary(self) -> dict[str, float]:
        return step_summary(self.pipelines)


@dataclasses.dataclass(frozen=True)
class DataTrainResult:
    losses: tuple[float, ...]
    real_tokens: int
    slots: int
    seconds: float           # measured step time (host assignment and layout included), compilation excluded
    compile_s: float
    steps: tuple[StepRecord, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds

    @property
    def padding(self) -> float:
        """Padded token slots computed (bucket rounding and padding rows included) over all slots."""
        return 1.0 - self.real_tokens / self.slots

    def breakdown(self) -> dict[str, float]:
        """Seconds per part (`cfp.data.breakdown.PARTS`) summed over the steps."""
        return {k: sum(r.summary()[k] for r in self.steps) for k in PARTS}

    @property
    def cores_busy(self) -> float:
        """The process's CPU seconds over the steps' wall seconds (compilation excluded): how many cores the
        steps kept busy on average. On CPU devices that share a host's cores, a pipeline's idle or bubble time
        is lost only where this stays below the cores the process may use."""
        return cores_busy_over(self.steps)


def cores_busy_over(records: Sequence[StepRecord]) -> float:
    """`DataTrainResult.cores_busy` of the steps `records`."""
    return sum(r.cpu_seconds for r in records) / sum(r.seconds for r in records)


def span_ratios(records: Sequence[StepRecord]) -> list[float]:
    """Estimated / measured span of every pipeline that ran in the steps `records`."""
    return [t.estimated_span / t.span for rec in records for t in rec.pipelines if t.span > 0]


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity where the OS reports one): the bound of `cores_busy`."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ----------------------------------------------------------------------------- mixes
def parse_mixes(text: str) -> list[list[Shape]]:
    """Hydraulis' notation: a list of mixes, each a list of (cp, tp, pp) pipelines, e.g.
    ``"[[(1,2,2),(2,1,1),(1,2,1)], [(1,4,2)]]"``; one mix alone (``"[(1,4,2)]"``) is accepted too."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"mixes {text!r} is neither a mix JSON file nor Hydraulis' notation, "
                          "e.g. \"[[(1,2,2),(2,1,1),(1,2,1)], [(1,4,2)]]\"") from None
    if isinstance(value, tuple) and len(value) == 3 and all(isinstance(v, int) for v in value):
        value = [value]
    if isinstance(value, (list, tuple)) and value and all(_is_shape(v) for v in value):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"mixes {text!r} must be a non-empty list of mixes")
    out = []
    for i, st in enumerate(value):
        if not isinstance(st, (list, tuple)) or not st or not all(_is_shape(p) for p in st):
            raise ConfigError(f"mix {i} {st!r} must be a non-empty list of (cp, tp, pp) triples of "
                              "positive integers")
        out.append([tuple(int(v) for v in p) for p in st])
    return out


def _is_shape(v) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v))


def load_mixes(text: str) -> list[list[Shape]] | SchemeMix:
    """`--mixes`: a mix JSON file written by `cfp data propose`, else Hydraulis' notation."""
    if os.path.exists(text) or text.endswith(".json"):
        return SchemeMix.load(text)
    return parse_mixes(text)


def shapes_of(mixes: Sequence[Sequence[Shape]]) -> list[Shape]:
    """The distinct (cp, tp, pp) schemes the mixes use, in first-use order."""
    return list(dict.fromkeys(s for st in mixes for s in st))


def with_fits(mixes: Sequence[Sequence[Shape]], space: SchemeSpace) -> list[list[Scheme]]:
    """Each mix's pipelines as the space's fitted schemes; ConfigError naming a scheme without a fit."""
    fits = {s.shape: s for s in space.schemes}
    missing = [s for s in shapes_of(mixes) if s not in fits]
    if missing:
        raise ConfigError(f"the scheme space has no fit for (cp, tp, pp) {missing}; it has "
                          f"{sorted(fits)}")
    return [[fits[s] for s in st] for st in mixes]


def layout_of(pipelines: Sequence[Scheme], num_layers: int, num_devices: int):
    """The engine layout of a mix (consecutive devices); ConfigError if it needs too many devices."""
    from cfp.layout import Layout
    need = sum(s.devices for s in pipelines)
    if need > num_devices:
        raise ConfigError(f"mix {describe(pipelines)} needs {need} devices, only {num_devices} are "
                          "available")
    return Layout.from_schemes([s.shape for s in pipelines], num_layers)


def describe(pipelines: Sequence[Scheme]) -> str:
    return "[" + ", ".join(f"({s.cp},{s.tp},{s.pp})" for s in pipelines) + "]"


def uniform_mix(space: SchemeSpace, lengths, gpus: int, tokens_per_step: int) -> SchemeMix:
    """Best mix using one scheme only (what a fixed-mix system would run)."""
    best = None
    for s in space.schemes:
        if s.max_len < np.max(lengths) or s.devices > gpus:
            continue
        one = SchemeSpace(space.model, space.config, space.source, (s,))
        st = propose(one, lengths, gpus, tokens_per_step)
        if best is None or st.estimated_step_s < best.estimated_step_s:
            best = st
    if best is None:
        raise ConfigError(f"no single scheme holds the longest sequence ({int(np.max(lengths))} tokens)")
    return best


# ----------------------------------------------------------------------------- one step
def step_sequences(data: Sequences, step: int, seed: int, tokens_per_step: int) -> np.ndarray:
    """Indices of this step's sequences: a seeded shuffle, cut when the real tokens reach the budget."""
    order = np.random.default_rng([seed, step]).permutation(len(data))
    lens = data.lengths[order]
    n = int(np.searchsorted(np.cumsum(lens), tokens_per_step)) + 1
    return order[:min(n, order.size)]


def plan_step(opts: DataTrainOptions, candidates: Sequence[Sequence[Scheme]], lengths: np.ndarray
              ) -> tuple[int, list, tuple[float, ...], tuple[float, ...]]:
    """(chosen candidate, its per-pipeline micro-batches as indices into `lengths`, every candidate's fitted
    step time, the chosen one's per-pipeline spans): a pipeline's time alone is Σ micro-batch cost + (pp-1) x
    its slowest micro-batch, each micro-batch priced as it is laid out; side by side they share the devices
    (`shared_spans` with `opts.parallel_pipelines`); a step's time is its slowest pipeline's span."""
    packed = opts.method.packing is not Packing.PAD
    plans, est, per_pipe = [], [], []
    for pipes in candidates:
        try:
            plan = assign_step(opts.method, pipes, lengths, opts.ilp_max_sequences)
        except InfeasibleError:
            plans.append(None)
            est.append(float("inf"))
            per_pipe.append(())
            continue
        plans.append(plan)
        alone = [pipeline_time(s, lengths, mbs, packed) for s, mbs in zip(pipes, plan)]
        times = tuple(shared_spans(alone, opts.parallel_pipelines))
        per_pipe.append(times)
        est.append(max(times))
    k = int(np.argmin(est))
    if plans[k] is None:
        raise InfeasibleError(f"no mix holds the step's longest sequence ({int(lengths.max())} tokens)")
    return k, plans[k], tuple(est), per_pipe[k]


def train_step(opts: DataTrainOptions, data: Sequences, trainer, candidates, layouts, step: int,
               factors: Optional[dict] = None):
    """Draw, plan, arrange and run one step; (StepStats, StepRecord). ``factors``: per scheme, its fits' scale
    (`cfp.data.rescale`). The host's share (drawing, assignment, arranging rows, switching the mix) is timed
    with the step; compiling new shapes (`trainer.warm`) and moving into the run's first mix (step 0) are not."""
    t0, c0 = time.perf_counter(), time.process_time()
    ids = step_sequences(data, step, opts.seed, opts.tokens_per_step)
    lengths = data.lengths[ids]
    k, plan, est, per_pipe = plan_step(opts, scaled(candidates, factors or {}), lengths)
    pipes = candidates[k]
    packed = opts.method.packing is not Packing.PAD
    mbs = [[materialize(data.tokens, [int(ids[i]) for i in mb], packed) for mb in pl] for pl in plan]
    host, cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.set_layout(layouts[k])    # switching mix: part of the step, except into the first one
    if step > 0:
        host, cpu = host + time.perf_counter() - t0, cpu + time.process_time() - c0
    trainer.warm(mbs)                 # compiles new shapes outside the timed step
    c0 = time.process_time()
    stats = trainer.step(mbs)
    cpu += time.process_time() - c0
    times = step_breakdown(stats.events, stats.seconds, host, pipes, plan, lengths, packed, per_pipe)
    rec = StepRecord(mix=k, sequences=tuple(int(i) for i in ids), estimates=est, pipelines=tuple(times),
                     plan=tuple(tuple(tuple(mb) for mb in p) for p in plan), micro_batches=sum(len(p) for p in plan),
                     loss=stats.loss, real_tokens=stats.real_tokens, slots=stats.tokens,
                     seconds=host + stats.seconds, cpu_seconds=cpu)
    return stats, rec


def next_factors(opts: DataTrainOptions, factors: dict, candidates, rec: StepRecord) -> dict:
    """The factors the step after `rec` prices with: `rec`'s measured spans folded in (`cfp.data.rescale`), or
    unchanged without `opts.recalibrate`. In a multi-process job every process takes process 0's (`agreed`)."""
    if not opts.recalibrate:
        return factors
    new = updated(factors, candidates[rec.mix], rec.pipelines)
    import jax
    return agreed(new, candidates) if jax.process_count() > 1 else new


def agreed(factors: dict, candidates) -> dict:
    """Process 0's `factors` on every process (one small all-gather over the candidates' scheme shapes). Each
    process measures only the pipelines it runs, so its own factors differ from the others'; priced by them, the
    processes could choose different mixes for a step and enter different collectives (a hang or an abort)."""
    from cfp.runtime.host_state import process_allgather
    shapes = sorted({s.shape for mix in candidates for s in mix})    # the same on every process (not its keys)
    mine = np.array([factors.get(k, 1.0) for k in shapes], np.float32)
    first = np.asarray(process_allgather(mine))[0]
    return {k: float(v) for k, v in zip(shapes, first) if v != 1.0}


def run(opts: DataTrainOptions, data: Sequences, trainer, candidates: Sequence[Sequence[Scheme]],
        log: Optional[Callable[[str], None]] = print, verbose: bool = False) -> DataTrainResult:
    """Train `opts.steps` steps, each on the candidate mix rated fastest (fits rescaled by the steps before
    with `opts.recalibrate`); `log` one line per step with where its time went (`verbose`: one more per
    pipeline)."""
    n_dev = len(trainer.devices)
    layouts = [layout_of(p, trainer.model.num_layers, n_dev) for p in candidates]
    trainer.set_schedule(opts.schedule)
    if log:     # every micro-batch carries segment ids (padding is segment 0): the packed case, at the widest rows
        log(header_line(trainer.model.config, packed=True))
    losses, records, real, slots, secs, comp = [], [], 0, 0, 0.0, 0.0
    factors: dict = {}
    with heap.steady() as settle:     # the collector off the objects the first step compiled
        for step in range(opts.steps):
            c0 = trainer.warm_s
            st, rec = train_step(opts, data, trainer, candidates, layouts, step, factors)
            settle()
            comp += trainer.warm_s - c0
            factors = next_factors(opts, factors, candidates, rec)
            losses.append(st.loss)
            records.append(rec)
            real, slots, secs = real + rec.real_tokens, slots + rec.slots, secs + rec.seconds
            if log:
                log(step_line(step, rec, candidates))
                for t in rec.pipelines if verbose else ():
                    log("    " + format_pipeline(t))
    return DataTrainResult(tuple(losses), real, slots, secs, comp, tuple(records))


def estimate_accuracy(res: DataTrainResult) -> str:
    """The estimated / measured span of every pipeline that ran in every step: median and range."""
    r = span_ratios(res.steps)
    if not r:
        return "no pipeline ran"
    return f"median {np.median(r):.2f}, {min(r):.2f}..{max(r):.2f} over {len(r)}"


def step_line(step: int, rec: StepRecord, candidates) -> str:
    """A step's log line: mix, loss, throughput, padding and where the time went."""
    others = "" if len(candidates) == 1 else "  (estimated " + ", ".join(
        f"{i}: {e:.3g} s" for i, e in enumerate(rec.estimates)) + ")"
    return (f"step {step + 1}: mix {rec.mix} {describe(candidates[rec.mix])}{others}  loss "
            f"{rec.loss:.4f}  {rec.real_tokens} tokens in {rec.micro_batches} micro-batches  non-pad tokens/s: "
            f"{rec.real_tokens / rec.seconds:.0f}  padding: {100 * (1 - rec.real_tokens / rec.slots):.1f}% "
            f"(measured)\n    time: {format_summary(rec.summary())} (measured; compute split by the fits' "
            "shares)")


def verify_tolerance(config) -> float:
    """`cfp train --verify`'s tolerances: 1e-4 in float32 (measured 3.7e-8 over the 4 steps of docs/data.md's
    example, 1.3e-5 after a step at lr 1e-2 in the tests; a pipeline's tokens dropped is >1e-2), 5e-2 else."""
    return 1e-4 if config.dtype == "float32" else 5e-2


def check_verifiable(model: str, config) -> None:
    """ConfigError unless `--verify`'s reference (each sequence alone in its row) can equal a packed run: not for
    MoE models, whose top-2 routing keeps at most `expert_capacity` tokens per expert in each group of
    `expert_group_size` tokens (and averages the aux loss over those groups), so which tokens are dropped
    depends on which sequences (and padding) share a group."""
    if isinstance(config, MoEConfig):
        raise ConfigError(f"--verify of variable-length steps needs a dense model: {model}'s experts keep at most "
                          f"{config.expert_capacity} tokens each per group of {config.expert_group_size}, so its "
                          "loss depends on which sequences are packed together and no sequence-by-sequence "
                          "reference can equal it; train without --verify (or verify a dense model)")


def verify_run(opts: DataTrainOptions, data: Sequences, config, init_state, result: DataTrainResult,
               final_params, tol: float | None = None) -> tuple[float, bool]:
    """Replay every step on one device (each sequence alone in its row, `cfp.runtime.verify`); the largest
    relative error of the losses and the normwise one of the final parameters, and whether it is <= tol
    (default `verify_tolerance`)."""
    tol = verify_tolerance(config) if tol is None else tol
    from cfp.runtime.verify import loss_error, sequence_replay, tree_error
    check_verifiable(opts.model, config)
    steps = [[data.tokens[i] for i in rec.sequences] for rec in result.steps]
    ref_losses, ref_params = sequence_replay(opts.model, config, init_state[0], init_state[1], steps,
                                             learning_rate=opts.learning_rate,
                                             weight_decay=opts.weight_decay)
    err = max(loss_error(list(result.losses), ref_losses), tree_error(final_params, ref_params))
    return err, err <= tol
