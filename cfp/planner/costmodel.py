"""The planner's cost model of one training step of a model on a heterogeneous layout.

The model's figures -- per-device parameters and optimizer state, each dot's FLOPs and GEMM shape, memory-bound
bytes, kept activations, the TP all-reduces -- are `cfp.costs.ModelFigures`: for a zoo config
`cfp.costs.ModelCost`, which describes every model of the zoo once (GPT, Llama-2, GShard MoE, BERT), for any
`LayeredModel` its derived `cfp.layered.facts.CostFacts` (`cfp.layered.derive.derive_facts`). The runtime keeps only each micro-batch's stage input between forward and
backward and recomputes the stage forward in the backward program, so a stage's backward costs 3x its forward
(recompute + 2x for the gradients) and its activation peak is one micro-batch's whole stage.

Compute time: each dot at its own per-device GEMM shape's achievable rate from `cfp.hardware.rates` (the
precision from the dtype as JAX runs it, the large-GEMM efficiency and its fall-off for thin shapes; shared
with the profiling pass's estimate), so a high TP degree or a short micro-batch costs more per FLOP; the
elementwise and normalisation work (softmax, norms, residuals, activations, the loss, the embedding's dense
gradient) at the device's memory bandwidth (softmax passes at its softmax rate where its entry measured one: the
`cpu` entry). TP all-reduces add the device's fixed cost per collective (0 for the datasheet entries). MFU is
against the dense peaks of that precision.

Step time = slowest pipeline (the schedule's `cfp.schedules.registry.pipeline_time`: the sum of the stage
times plus (m-1) times the slowest stage, sends included) + gradient sync across pipelines (ring
all-reduce per layer over the slowest link) + the memory-bound AdamW update. Collectives come from
`cfp.hardware.collectives.collective_time`. Unlike FlashFlex's model no empirical factors (1.8, 1.1)
are applied: they were fitted to its testbed and nothing here can re-fit them.

`features` (`cfp.planner.step_features.StepFeatures`) says how the step runs; its default is cfp's runtime as
above. Other values price other systems' runs through the same figures: no recomputation (backward 2x the
forward, every in-flight micro-batch's activations kept), fused attention, an all-reduce or FSDP sync (and
sharded state), data-parallel traffic overlapped with compute.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np

from cfp.costs import Part, model_figures
from cfp.hardware import rates
from cfp.hardware.collectives import collective_time
from cfp.hardware.gpus import GpuSpec, Precision
from cfp.layout import Layout, Pipeline, Stage
from cfp.planner.cluster import Cluster
from cfp.planner.measured import MeasuredStageTimes, StageShape
from cfp.planner.step_features import (CFP_RUNTIME, Among, GradSync, StepFeatures, backward_passes,
                                      collective_sync_seconds)
from cfp.recompute import Recompute
from cfp.schedules import formulas
from cfp.schedules.registry import ScheduleName, ScheduleSpec, schedule_choices


_MISSING = object()
Places = "int | Among"      # a pipeline's place among the layout's pipelines (an int n: pipeline 0 of n)


def _memo(fn):
    """Per-instance memo of a figure (its arguments are small hashable numbers)."""
    @functools.wraps(fn)
    def wrapper(self, *args):
        key = (fn.__name__,) + args
        value = self._memo.get(key, _MISSING)
        if value is _MISSING:
            value = self._memo[key] = fn(self, *args)
        return value
    return wrapper


def achievable_flops(gpu: GpuSpec, precision: Precision) -> float:
    """FLOP/s of a large GEMM on `gpu` in `precision` (`cfp.hardware.rates`, shared with the profiling
    pass): the planner's measure of a device's speed for METIS' vertex weights and the greedy baseline."""
    return rates.achievable_flops(gpu, precision)


def precision_of(dtype: str, gpu: GpuSpec) -> Precision:
    """The arithmetic of the model's dots on `gpu` (`cfp.hardware.rates.dot_precision` under JAX's default
    matmul precision: bfloat16 on BF16 tensor cores, float32 as TF32 where the device has it)."""
    return rates.dot_precision(dtype, None, gpu)


def _flops(gemms) -> float:
    return sum(f for f, _ in gemms)


def _host_sums(parts) -> list[float]:
    """Per shared-host machine, the sum of its (machine, seconds) entries over pipelines (0.0 if none)."""
    total: dict[int, float] = {}
    for items in parts:
        for m, t in items:
            total[m] = total.get(m, 0.0) + t
    return list(total.values()) or [0.0]


# ----------------------------------------------------------------------------- estimate
@dataclass(frozen=True)
class StageEstimate:
    fwd: float          # seconds per micro-batch, compute + TP collectives
    bwd: float
    send: float         # seconds to send one micro-batch's activation to the next stage
    memory: float       # peak bytes per device
    capacity: float     # bytes per device
    flops_fwd: float    # per device, per micro-batch
    flops_bwd: float
    update: float = 0.0  # seconds of the AdamW update (memory-bound)
    measured: bool = False  # fwd/bwd from a measured stage time (`MeasuredStageTimes`), not the model
    params: float = 0.0     # parameters per device
    wgrad: float = 0.0      # the part of `bwd` that is the weight gradient (W of a split backward)
    recompute: Recompute = Recompute.FULL   # the stage's recompute policy its figures are priced with


def _with_memory(times: StageEstimate, memory: float, policy: Recompute) -> StageEstimate:
    """`times` with its peak memory and recompute policy: copied without the frozen dataclass' __init__, which
    sets each of its 12 fields through object.__setattr__ (~29,000 stage figures at 1024 GPUs)."""
    e = object.__new__(StageEstimate)
    e.__dict__.update(times.__dict__, memory=memory, recompute=policy)
    return e


@dataclass(frozen=True)
class Estimate:
    step_time: float
    tokens_per_s: float
    mfu: float
    pipeline_time: tuple[float, ...]
    dp_time: float
    update_time: float
    stages: tuple[tuple[StageEstimate, ...], ...]
    fits: bool
    peak_flops: float = field(repr=False, default=0.0)
    schedules: tuple[ScheduleSpec, ...] = ()    # per pipeline, the schedule it is priced with
    # per pipeline, every schedule tried: (schedule, pipeline seconds, whether its stages fit in memory)
    schedule_options: tuple[tuple[tuple[ScheduleSpec, float, bool], ...], ...] = field(repr=False, default=())

    @property
    def objective(self) -> float:
        """What the planner minimises: step time per sequence, infinite when memory does not fit."""
        return self.step_time if self.fits else math.inf


class MemoryTerms(NamedTuple):
    """A stage's memory per device in bytes, (fixed, per layer) pairs: `s` parameters (as many gradient bytes
    in the accumulator, and per pipeline gathered at the sync), `a` the backward's working set, `o` the
    optimizer state (0 on the stages of pipelines other than 0, which hold none). A stage of n layers peaks at
    2 S + O + max(A, G S) with S = s0 + n s1, O = o0 + n o1, A = a0 + n a1 and G parameter-sized copies
    received after the backward (`stage_memory`, `StepFeatures.gathered_copies`)."""
    s0: float
    s1: float
    a0: float
    a1: float
    o0: float
    o1: float

    def state(self, n: int) -> float:
        """Parameters, gradient accumulator and optimizer state of n layers."""
        return 2 * (self.s0 + n * self.s1) + self.o0 + n * self.o1

    def peak(self, n: int, gathered: int) -> float:
        """Peak bytes of n layers with `gathered` parameter-sized copies received after the backward."""
        return self.state(n) + max(self.a0 + n * self.a1, gathered * (self.s0 + n * self.s1))


@dataclass(frozen=True)
class _PipelineFigures:
    stages: tuple[StageEstimate, ...]
    time: float                     # the pipeline's forward-backward time, seconds
    layer_tp: np.ndarray            # TP degree per layer
    tp_token: int                   # one per distinct `layer_tp` (`_shape_figures`)
    bounds: tuple[int, ...]         # the first layer of each stage, then the number of layers
    fits: bool
    peak: float                     # dense peak FLOP/s of its devices
    machines: frozenset
    share: tuple[float, ...]        # per stage: its devices' share of their host (0: not a shared host)
    host_busy: tuple[tuple[int, float], ...]    # (shared-host machine, its compute seconds for this pipeline)
    host_update: tuple[tuple[int, float], ...]  # (shared-host machine, its update seconds for this pipeline)
    own_update: float               # the slowest update among stages on machines of their own
    schedule: ScheduleSpec = None   # the schedule it is priced with
    options: tuple = ()             # (schedule, seconds, fits) of every schedule tried


@dataclass(frozen=True)
class CostModel:
    """Estimates a `Layout` of `config` (a zoo model config, or a model's `ModelFigures`: its derived
    `CostFacts`) on `cluster` with `schedule` (one schedule, a list of them or "auto",
    `cfp.schedules.registry.schedule_choices`: each pipeline is priced with the fastest of them whose activation
    memory fits; stages are sized by the first); stages whose shape and device `stage_times` has measured are
    priced by the measured time (their TP collectives included in it); `features`: how the step runs (default:
    cfp's runtime)."""
    config: Any
    cluster: Cluster
    schedule: Any = ScheduleName.GPIPE
    stage_times: Optional[MeasuredStageTimes] = None
    features: StepFeatures = CFP_RUNTIME

    def __post_init__(self):
        fused = self.features.attention_fused(self.config, self.cluster)    # the runtime's choice unless given
        object.__setattr__(self, "model", model_figures(self.config, fused))
        object.__setattr__(self, "_machines", self.cluster.machine_of())
        ms = self.cluster.machines       # machines of one spec price alike: memo keys use the first's index
        object.__setattr__(self, "kind", tuple(ms.index(m) for m in ms))
        prec = [precision_of(self.model.dtype, m.gpu) for m in self.cluster.machines]
        object.__setattr__(self, "_precision", prec)
        object.__setattr__(self, "_peak", [m.gpu.peak(p) for m, p in zip(self.cluster.machines, prec)])
        object.__setattr__(self, "_rate", [achievable_flops(m.gpu, p) for m, p in zip(self.cluster.machines, prec)])
        object.__setattr__(self, "choices", schedule_choices(self.schedule))
        object.__setattr__(self, "spec", self.choices[0])
        object.__setattr__(self, "_stage_memo", {})
        object.__setattr__(self, "_pipe_memo", {})
        object.__setattr__(self, "_figs_memo", {})
        object.__setattr__(self, "_memo", {})
        object.__setattr__(self, "build_memo", {})     # `cfp.planner.build`'s memo of layer splits

    def rate(self, machine: int) -> float:
        """A large GEMM's FLOP/s on `machine`'s devices (their speed, for partitioning)."""
        return self._rate[machine]

    def _dot_seconds(self, machine: int, gemms) -> float:
        gpu, prec = self.cluster.machines[machine].gpu, self._precision[machine]
        return sum(f / rates.achievable_flops(gpu, prec, *mnk) for f, mnk in gemms)

    @_memo
    def layer_seconds(self, machine: int, tp: int, mb: int, spilled: bool = False) -> float:
        """Forward compute of one layer on `mb` sequences: each dot at its shape's achievable rate
        (`cfp.hardware.rates`), the elementwise and normalisation work at memory bandwidth (memory-bound;
        `spilled`: in a stage whose working set exceeds the device's cache, `spills`)."""
        m = self.model
        return (self._dot_seconds(machine, m.layer_gemms(tp, mb))
                + self._elementwise_seconds(machine, mb * m.layer_elementwise_bytes(tp),
                                            mb * m.layer_score_bytes(tp), spilled))

    @_memo
    def layer_weight_dot_seconds(self, machine: int, tp: int, mb: int) -> float:
        """The parameter dots of one layer's forward on `mb` sequences (as many FLOPs as its weight gradient)."""
        return self._dot_seconds(machine, self.model.layer_weight_gemms(tp, mb))

    @_memo
    def head_dot_seconds(self, machine: int, tp: int, mb: int) -> float:
        """The dots of the LM head's forward on `mb` sequences."""
        return self._dot_seconds(machine, self.model.head_gemms(tp, mb))

    @_memo
    def head_seconds(self, machine: int, tp: int, mb: int, spilled: bool = False) -> float:
        """Forward compute of the LM head (and its loss) on `mb` sequences, like `layer_seconds`."""
        m = self.model
        return (self._dot_seconds(machine, m.head_gemms(tp, mb))
                + self._elementwise_seconds(machine, mb * m.head_elementwise_bytes(tp),
                                            mb * m.head_score_bytes(tp), spilled))

    def spills(self, st: Stage, mb: int, last: bool) -> bool:
        """Whether the stage's programs stream through more than its device's cache (`GpuSpec.spills`): the
        activations one micro-batch leaves in the stage for its backward."""
        m = self.model
        return self.cluster.machines[st.machine].gpu.spills(
            mb * (st.layers * m.layer_activation_bytes(st.tp) + (m.head_activation_bytes(st.tp) if last else 0.0)))

    @_memo
    def embed_seconds(self, machine: int, tp: int, mb: int) -> tuple[float, float]:
        """(forward, backward beyond the recomputed forward) of the embedding on `mb` sequences: its dots (the
        zoo's: none), memory-bound gathers, and the backward's weight gradients (the zoo's: the dense float32
        gradient of the token table)."""
        fwd, bwd, bwd_row = self.model.embed_elementwise_bytes(tp)
        dots = self._dot_seconds(machine, self.model.embed_gemms(tp, mb))
        bw = self._mem_bw(machine)
        return dots + mb * fwd / bw, dots + (bwd + mb * bwd_row) / bw

    def _elementwise_seconds(self, machine: int, nbytes: float, softmax_bytes: float, spilled: bool) -> float:
        """Memory-bound work of `nbytes`, of which `softmax_bytes` are softmax passes (at the device's softmax
        rate: on a CPU the exponentials, not the memory, bound them)."""
        gpu = self.cluster.machines[machine].gpu
        bw = gpu.mem_bandwidth(spilled)
        if gpu.softmax_gbps is None:
            return nbytes / bw
        return (nbytes - softmax_bytes) / bw + softmax_bytes / gpu.softmax_bandwidth

    def _mem_bw(self, machine: int) -> float:
        return self.cluster.machines[machine].gpu.mem_bandwidth()

    def _stream_seconds(self, machine: int, nbytes: float) -> float:
        """One memory-bound pass over `nbytes` (beyond the cache where they exceed it, `GpuSpec.spills`)."""
        gpu = self.cluster.machines[machine].gpu
        return nbytes / gpu.mem_bandwidth(gpu.spills(nbytes))

    def precisions(self) -> tuple[Precision, ...]:
        """The arithmetic of the model's dots on each device type used (sorted, distinct)."""
        return tuple(sorted(set(self._precision), key=lambda p: p.value))

    def peak(self, machine: int) -> float:
        """Dense peak FLOP/s of `machine`'s devices in the arithmetic the model's dots run in."""
        return self._peak[machine]

    def stored_inputs(self, stage_index: int, num_stages: int, chunks: int, spec: ScheduleSpec = None) -> int:
        """Virtual-stage inputs a stage keeps between forward and backward at most under the schedule."""
        return self.placed(num_stages, chunks, spec)[1][stage_index][0]

    @_memo
    def placed(self, num_stages: int, chunks: int, spec: ScheduleSpec = None) -> tuple[int, tuple]:
        """(the stage holding the head, per stage its (inputs, W stashes) at most: `Schedule.counts`) of a
        pipeline under ``spec`` (default: the base schedule)."""
        spec = spec or self.spec
        e = spec.entry
        return (e.head_stage(num_stages, spec.v),
                tuple(e.counts(i, num_stages, chunks, spec.v) for i in range(num_stages)))

    def stage_flops(self, st: Stage, first: bool, last: bool, mb: int, policy: Recompute = None
                    ) -> tuple[float, float]:
        """Per-device FLOPs of the stage's forward and backward (recompute included) programs under `policy`
        (default: the least recomputation the step's features allow, what the runtime runs unless told)."""
        m = self.model
        policy = policy or self.features.policies[0]
        f = mb * (st.layers * m.layer_flops(st.tp) + (m.head_flops(st.tp) if last else 0.0))
        grads = mb * (st.layers * m.layer_backward_flops(st.tp) + (m.head_backward_flops(st.tp) if last else 0.0))
        if policy is Recompute.SELECTIVE:       # everything of the forward but the parameter dots, again
            dots = mb * (st.layers * _flops(m.layer_weight_gemms(st.tp, 1)) + (_flops(m.head_gemms(st.tp, 1))
                                                                             if last else 0.0))
            return f, grads + max(0.0, f - dots)
        return f, (backward_passes(policy) - 2) * f + grads

    def stage_params(self, st: Stage, first: bool, last: bool) -> float:
        m = self.model
        return (st.layers * m.layer_params(st.tp) + (m.embed_params(st.tp) if first else 0.0)
                + (m.head_params(st.tp) if last else 0.0))

    def _stage_bytes(self, fig, st: Stage, first: bool, last: bool) -> float:
        return (st.layers * fig(Part.LAYER, st.tp) + (fig(Part.EMBED, st.tp) if first else 0.0)
                + (fig(Part.HEAD, st.tp) if last else 0.0))

    def update_bytes(self, st: Stage, first: bool, last: bool) -> float:
        """Bytes the optimizer update moves per device: parameters and optimizer state read and written, the
        gradient read (AdamW in float32: 7 x 4 per parameter)."""
        m = self.model
        return (3 * self._stage_bytes(m.param_bytes, st, first, last)
                + 2 * self._stage_bytes(m.optimizer_bytes, st, first, last))

    def memory_terms(self, st: Stage, idx: int, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec = None,
                     policy: Recompute = None) -> MemoryTerms:
        """A stage's `MemoryTerms` (P pipelines) under ``spec`` (default: the base schedule) and recompute
        `policy` (default: the stage's, `stage_policy`), see `stage_memory`."""
        spec = spec or self.spec
        policy = policy or self.stage_policy(st, idx, pipe, n_pipes, spec)
        head, counts = self.placed(len(pipe.stages), pipe.chunks, spec)
        return self._memory_terms(st.tp, idx == 0, idx == head, counts[idx], spec.v, pipe.micro_batch, n_pipes,
                                  policy)

    def stage_policy(self, st: Stage, idx: int, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec = None
                     ) -> Recompute:
        """The stage's recompute policy: the least recomputation among the features' policies whose peak fits its
        devices' memory (`auto`), else the leanest (the stage does not fit)."""
        return self._policy_peak(st, idx, pipe, n_pipes, spec)[0]

    def _policy_peak(self, st: Stage, idx: int, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec = None
                     ) -> tuple[Recompute, float]:
        """(`stage_policy`, the stage's peak under it), memoised together: the choice prices the peaks, and the
        search asks for the peak at the stage's own policy (`stage_memory`) as often as for the policy."""
        options = self.features.policies
        if len(options) == 1 or st.machine is None:     # (no machine, no memory: the runtime's own default)
            return options[0], self._peak_bytes(st, idx, pipe, n_pipes, spec, options[0])
        spec = spec or self.spec
        head, stored = self.placed(len(pipe.stages), pipe.chunks, spec)
        key = ("stage_policy", self.kind[st.machine], len(st.devices), st.layers, idx == 0, idx == head, stored[idx],
               spec.v, pipe.micro_batch, n_pipes)     # all a stage's peak depends on (`_memory_terms`)
        hit = self._memo.get(key)
        if hit is None:
            cap = self.cluster.machines[st.machine].memory
            g, n, tp, mb = self.features.gathered_copies(n_pipes), st.layers, st.tp, pipe.micro_batch
            for p in options:       # (`memory_terms` with the placement above)
                peak = self._memory_terms(tp, idx == 0, idx == head, stored[idx], spec.v, mb, n_pipes, p).peak(n, g)
                if peak <= cap or p is options[-1]:
                    break
            hit = self._memo[key] = (p, peak)
        return hit

    @_memo
    def residual_bytes(self, tp: int, policy: Recompute) -> float:
        """Bytes per sequence one layer keeps from its forward to its backward under `policy`, beyond the stage
        input (`cfp.ir.backward_split`'s cuts): `none` every value the backward reads (`layer_activation_bytes`);
        `selective` the outputs of its dots without batch dims (jax.checkpoint_policies.
        dots_with_no_batch_dims_saveable's rule: the parameter dots' outputs, counted from the layer's own GEMMs,
        in the activation dtype); `full` nothing."""
        m = self.model
        if policy is Recompute.FULL:
            return 0.0
        whole = m.layer_activation_bytes(tp)
        if policy is Recompute.NONE:
            return whole
        outputs = sum(f / (2 * k) for f, (_, _, k) in m.layer_weight_gemms(tp, 1)) * m.act_bytes
        return min(whole, outputs)

    @_memo
    def _memory_terms(self, tp: int, first: bool, last: bool, stored: tuple[int, int], v: int, mb: int,
                      n_pipes: Places, policy: Recompute = Recompute.FULL) -> MemoryTerms:
        """Memoised in two parts (a 1024-GPU plan asks ~40,000 combinations, most differing only in the place):
        the state by TP degree and ends alone, the working set (`_working_set`) without the place."""
        share, opt = self.features.state_share(n_pipes), self.features.optimizer_share(n_pipes)
        params, layer_params, state, layer_state = self._state_bytes(tp, first, last)
        a0, a1 = self._working_set(tp, first, last, stored, v, mb, policy)
        # only what a pipeline's stages hold: the optimizer state on pipeline 0's alone (`Among`)
        return MemoryTerms(share * params, share * layer_params, a0, a1, opt * state, opt * layer_state)

    @_memo
    def _state_bytes(self, tp: int, first: bool, last: bool) -> tuple[float, float, float, float]:
        """(parameter bytes of the ends, of a layer, optimizer state of the ends, of a layer) per device."""
        m = self.model
        ends = lambda fig: (fig(Part.EMBED, tp) if first else 0.0) + (fig(Part.HEAD, tp) if last else 0.0)
        return (ends(m.param_bytes), m.param_bytes(Part.LAYER, tp), ends(m.optimizer_bytes),
                m.optimizer_bytes(Part.LAYER, tp))

    @_memo
    def _working_set(self, tp: int, first: bool, last: bool, stored: tuple[int, int], v: int, mb: int,
                     policy: Recompute) -> tuple[float, float]:
        """(a0, a1) of `MemoryTerms`: the backward's working set, fixed and per layer."""
        m = self.model
        n_in, n_stash = stored
        # kept virtual-stage inputs (token ids only where the stage's one virtual stage is the first)
        inputs = n_in * mb * (m.token_bytes() if first and v == 1 else m.boundary_bytes())
        # the embedding's backward transients (the zoo's: its gradient built densely before it joins the
        # accumulator) and one layer's backward transients
        a0 = (inputs + (mb * m.head_activation_bytes(tp) if last else 0.0)
              + (m.embed_backward_bytes(tp) if first else 0.0) + mb * m.layer_temp_bytes(tp))
        # the running backward's micro-batch holds its stage's activations whole (what its policy did not keep,
        # recomputed), every other kept input its virtual stage's residuals (`residual_bytes`), plus the W stashes
        # of a split backward (a virtual stage's parameter dots' inputs and output gradients each)
        kept = self.residual_bytes(tp, policy)
        a1 = mb * (m.layer_activation_bytes(tp) - kept + max(1.0, n_in / v) * kept
                   + n_stash / v * m.layer_weight_stash_bytes(tp))
        return a0, a1

    def pipeline_memory_floor(self, n_pipes, tps: tuple[int, ...]) -> float:
        """Bytes the devices of one pipeline at `n_pipes` (an `Among`; an int: pipeline 0) hold together at
        least, at any split into stages of TP degrees `tps`: every stage's peak (`stage_memory`) is at least its
        parameters, accumulator, optimizer state and the copies received after the backward, and a stage of TP t
        holds at least 1/t of its layers' figures per device, so the pipeline's devices hold the whole model's
        (at its least over `tps`) that many times."""
        m, f = self.model, self.features
        g = f.gathered_copies(n_pipes)
        least = lambda fig: min(t * (m.num_layers * fig(Part.LAYER, t) + fig(Part.EMBED, t) + fig(Part.HEAD, t))
                                for t in tps)
        return f.state_share(n_pipes) * (2 + g) * least(m.param_bytes) + f.optimizer_share(n_pipes) * least(
            m.optimizer_bytes)

    def layer_capacity(self, st: Stage, idx: int, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec = None) -> int:
        """Most layers stage `idx` holds within its devices' memory (both terms of the peak are linear in
        the number of layers)."""
        cap = self.cluster.machines[st.machine].memory
        t = self.memory_terms(st, idx, pipe, n_pipes, spec, self.features.policies[-1])   # the leanest policy
        g = self.features.gathered_copies(n_pipes)
        # 2(s0 + n s1) + o0 + n o1 + a0 + n a1 <= cap  and  (2 + G)(s0 + n s1) + o0 + n o1 <= cap
        n1 = (cap - 2 * t.s0 - t.o0 - t.a0) / (2 * t.s1 + t.o1 + t.a1)
        n2 = (cap - (2 + g) * t.s0 - t.o0) / ((2 + g) * t.s1 + t.o1)
        return int(math.floor(min(n1, n2) * (1 + 1e-12)))

    def layer_capacities(self, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec = None) -> Iterator[int]:
        """`layer_capacity` of every stage of `pipe` in order, lazily (a caller may stop at a stage that cannot
        hold a layer), memoised on what it depends on (planning at scale asks ~10^6 times, hence the flat loop)."""
        spec = spec or self.spec
        stages, memo, kind = pipe.stages, self._memo, self.kind
        n, mb = len(stages), pipe.batch // pipe.chunks
        head, stored = self.placed(n, pipe.chunks, spec)
        for i, st in enumerate(stages):
            key = ("layer_capacity", kind[st.machine], len(st.devices), i == 0, i == head, stored[i], spec.v, mb,
                   n_pipes)
            cap = memo.get(key)
            if cap is None:
                cap = memo[key] = self.layer_capacity(st, i, pipe, n_pipes, spec)
            yield cap

    def stage_memory(self, st: Stage, idx: int, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec = None,
                     policy: Recompute = None) -> float:
        """Peak bytes per device of stage `idx` of a pipeline at `n_pipes` (`Among`: pipeline 0 or another):
        params + gradient accumulator (+ optimizer state on pipeline 0's stages only), plus the larger of the
        backward's working set (kept inputs, their residuals and W stashes + one micro-batch's stage activations
        and transients) and what arrives after it (on pipeline 0 the other pipelines' gradients, on the others
        pipeline 0's new parameters: `StepFeatures.gathered_copies`); under `policy` (default: the stage's,
        `stage_policy`)."""
        if policy is None:
            return self._policy_peak(st, idx, pipe, n_pipes, spec)[1]
        return self._peak_bytes(st, idx, pipe, n_pipes, spec, policy)

    def _peak_bytes(self, st: Stage, idx: int, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec,
                    policy: Recompute) -> float:
        return self.memory_terms(st, idx, pipe, n_pipes, spec, policy).peak(st.layers,
                                                                            self.features.gathered_copies(n_pipes))

    def stage_estimate(self, st: Stage, idx: int, pipe: Pipeline, n_pipes: Places,
                       nxt: Stage | None, spec: ScheduleSpec = None) -> StageEstimate:
        """Memoised on what the figures depend on (`_cached_stage`: not on which devices of the machine)."""
        spec = spec or self.spec
        head, stored = self.placed(len(pipe.stages), pipe.chunks, spec)
        return self._cached_stage(st, idx, pipe, (idx == head, stored[idx], spec), n_pipes, nxt)

    def stage_estimates(self, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec = None, shape: tuple = None
                        ) -> tuple[StageEstimate, ...]:
        """`stage_estimate` of every stage of `pipe` under ``spec`` (default: the base schedule), memoised on the
        pipeline's shape (`pipeline_shape`: every stage's `_cached_stage` key is made of it, its batch, chunks, place
        and schedule), so a pipeline met again costs one key instead of one per stage (planning 1024 GPUs asks
        ~22,000 times for pipelines of ~15 stages); `shape`: the pipeline's, where the caller has it."""
        spec = spec or self.spec
        shape = shape or self.pipeline_shape(pipe)
        key = ("stage_estimates", shape, pipe.batch, pipe.chunks, n_pipes, spec)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._stage_estimates(pipe, n_pipes, spec, shape)
        return hit

    def _stage_estimates(self, pipe: Pipeline, n_pipes: Places, spec: ScheduleSpec, shape: tuple
                         ) -> tuple[StageEstimate, ...]:
        """Per stage `_cached_stage`, whose memo is looked up here with the key made from `shape` (the same key:
        ~200,000 lookups at 1024 GPUs, most of them hits)."""
        stages, (per_stage, links) = pipe.stages, shape
        n, mb, memo = len(stages), pipe.micro_batch, self._stage_memo
        head, stored = self.placed(n, pipe.chunks, spec)
        out = []
        for i, st in enumerate(stages):
            kind, width, layers = per_stage[i]
            key = (kind, width, layers, i == 0, (i == head, stored[i], spec), mb, n_pipes,
                   links[i] if i + 1 < n else -1.0)
            e = memo.get(key)
            out.append(e if e is not None else
                       self._cached_stage(st, i, pipe, key[4], n_pipes, stages[i + 1] if i + 1 < n else None))
        return tuple(out)

    def pipeline_shape(self, pipe: Pipeline) -> tuple:
        """All a pipeline's stage figures depend on beyond its batch, chunks and place: per stage its machine's spec,
        TP degree and layers, and the links between consecutive stages (not which devices or machines)."""
        st, kind, link = pipe.stages, self.kind, self.cluster.link
        return (tuple((kind[s.machine], len(s.devices), s.layers) for s in st),
                tuple(link(a.machine, b.machine) for a, b in zip(st, st[1:])))

    def _cached_stage(self, st: Stage, idx: int, pipe: Pipeline, place: tuple, n_pipes: Places,
                      nxt: Stage | None) -> StageEstimate:
        """`_stage_estimate` memoised on what its figures depend on: the machine's spec, TP degree, layers,
        place (first, holding the head, kept inputs and stashes, schedule), micro-batch, pipelines and the link to
        the next stage."""
        key = (self.kind[st.machine], len(st.devices), st.layers, idx == 0, place, pipe.micro_batch,
               n_pipes, -1.0 if nxt is None else self.cluster.link(st.machine, nxt.machine))
        e = self._stage_memo.get(key)
        if e is None:
            policy, memory = self._policy_peak(st, idx, pipe, n_pipes, place[2])
            # the times do not depend on the schedule beyond where the head is: memoised apart from the memory
            tkey = key[:4] + (place[0], policy) + key[5:]
            times = self._stage_memo.get(tkey)
            if times is None:
                times = self._stage_memo[tkey] = self._stage_estimate(st, idx, pipe, n_pipes, nxt, place[0], policy)
            e = self._stage_memo[key] = _with_memory(times, memory, policy)
        return e

    def _stage_estimate(self, st: Stage, idx: int, pipe: Pipeline, n_pipes: Places,
                        nxt: Stage | None, last: bool, policy: Recompute) -> StageEstimate:
        """The stage's figures under recompute `policy` but its memory (left 0: `_cached_stage` adds it per
        schedule)."""
        m = self.model
        first = idx == 0
        mb = pipe.micro_batch
        ff, fb = self.stage_flops(st, first, last, mb, policy)
        spilled = self.spills(st, mb, last)
        compute = (st.layers * self.layer_seconds(st.machine, st.tp, mb, spilled)
                   + (self.head_seconds(st.machine, st.tp, mb, spilled) if last else 0.0))
        ar = m.layer_all_reduces(st.tp) * self.tp_all_reduce_seconds(st.machine, st.tp, mb * m.boundary_bytes())
        emb_f, emb_b = self.embed_seconds(st.machine, st.tp, mb) if first else (0.0, 0.0)
        fwd = compute + emb_f + st.layers * ar                   # after attention, after the MLP
        k = backward_passes(policy)                              # (recomputed forward +) backward (2x)
        bwd = k * compute + (k - 2) * emb_f + emb_b + (k - 1) * st.layers * ar
        if policy is Recompute.SELECTIVE:   # B recomputes all but the parameter dots (their outputs were kept)
            bwd += (st.layers * (self.layer_seconds(st.machine, st.tp, mb, spilled)
                                 - self.layer_weight_dot_seconds(st.machine, st.tp, mb))
                    + (self.head_seconds(st.machine, st.tp, mb, spilled) - self.head_dot_seconds(st.machine, st.tp, mb)
                       if last else 0.0))
        # W: the weight-gradient dots (as many FLOPs as the forward's dots) and the embedding's gradient
        wgrad = (st.layers * self.layer_weight_dot_seconds(st.machine, st.tp, mb)
                 + (self.head_dot_seconds(st.machine, st.tp, mb) if last else 0.0) + emb_b)
        measured = self._measured(st, first, last, mb)
        if measured is not None:                        # split 1:3 like the modelled compute
            share = wgrad / bwd if bwd > 0 else 0.0
            fwd, bwd = measured / 4, 3 * measured / 4
            wgrad = share * bwd
        send = 0.0
        if nxt is not None:
            send = mb * m.boundary_bytes() / self.cluster.link(st.machine, nxt.machine)
        cap = self.cluster.machines[st.machine].memory
        upd = self._stream_seconds(st.machine, self.update_bytes(st, first, last) * self.features.state_share(n_pipes))
        return StageEstimate(fwd=fwd, bwd=bwd, send=send, memory=0.0, capacity=cap, flops_fwd=ff, flops_bwd=fb,
                             update=upd, measured=measured is not None, params=self.stage_params(st, first, last),
                             wgrad=wgrad)

    def tp_all_reduce_seconds(self, machine: int, tp: int, nbytes: float) -> float:
        """One ring all-reduce of `nbytes` per device over a TP group of `machine` (`collective_time` at the
        machine's link, plus the device's fixed cost per collective where its entry has one)."""
        if tp <= 1:
            return 0.0
        m = self.cluster.machines[machine]
        return collective_time("all-reduce", nbytes, tp, m.intra_bandwidth) + m.gpu.collective_latency_s

    def _measured(self, st: Stage, first: bool, last: bool, mb: int) -> Optional[float]:
        if self.stage_times is None:
            return None
        gpu = self.cluster.machines[st.machine].gpu.name
        return self.stage_times.lookup(gpu, StageShape(st.tp, st.layers, first, last, mb))

    def pipeline_time(self, stages: tuple[StageEstimate, ...], chunks: int, spec: ScheduleSpec = None) -> float:
        """The schedule's pipeline time (`cfp.schedules.formulas`) of stages that each take their forward,
        backward (B, then W) and the sends in and out of them (not overlapped with compute; v times over with v
        virtual stages per stage, half with the forward, half with B) per micro-batch."""
        spec = spec or self.spec
        if spec.entry.seconds is formulas.one_f_one_b_seconds:       # the sums are all it needs (planning at scale)
            prev_send = [0.0] + [s.send for s in stages[:-1]]
            return formulas.pipeline_time([s.fwd + s.bwd + s.send + p for s, p in zip(stages, prev_send)],
                                               chunks)
        f, b, w = self.action_seconds(stages, spec)
        return spec.entry.seconds(f, b, w, chunks, spec.v)

    @staticmethod
    def action_seconds(stages: tuple[StageEstimate, ...], spec: ScheduleSpec
                       ) -> tuple[list[float], list[float], list[float]]:
        """Per stage, the seconds of its F, B and W per micro-batch (sends included, see `pipeline_time`)."""
        prev_send = [0.0] + [s.send for s in stages[:-1]]
        sends = [spec.v * (s.send + p) / 2 for s, p in zip(stages, prev_send)]
        return ([s.fwd + x for s, x in zip(stages, sends)], [s.bwd - s.wgrad + x for s, x in zip(stages, sends)],
                [s.wgrad for s in stages])

    def _pipeline(self, pipe: Pipeline, n_pipes: Places) -> _PipelineFigures:
        """Memoised figures of one pipeline among `n_pipes` (refinement re-estimates layouts that differ
        in one or two pipelines)."""
        key = (pipe, n_pipes)
        figs = self._figs_memo.get(key)
        if figs is None:
            figs = self._figs_memo[key] = self._pipeline_figures(pipe, n_pipes)
        return figs

    def _priced(self, pipe: Pipeline, n_pipes: Places) -> tuple:
        """(schedule, stage estimates, seconds, every schedule's (spec, seconds, fits)) of the fastest schedule
        whose stages fit, else the base one; memoised on the pipeline's shape -- per stage its machine's spec, TP
        degree, layers and link to the next -- which is all they depend on (pipelines of like machines, e.g. the
        equal-share cut's, share it)."""
        shape = self.pipeline_shape(pipe)
        key = (shape, pipe.batch, pipe.chunks, n_pipes)
        hit = self._pipe_memo.get(key)
        if hit is not None:
            return hit
        options, best = [], None
        for spec in self.choices:       # the fastest schedule whose stages fit; else the base one
            ests = self.stage_estimates(pipe, n_pipes, spec, shape)
            t = self.pipeline_time(ests, pipe.chunks, spec)
            fits = all(e.memory <= e.capacity for e in ests)
            options.append((spec, t, fits))
            if best is None or (fits and (not best[3] or t < best[2])):
                best = (spec, ests, t, fits)
        hit = self._pipe_memo[key] = (best[0], best[1], best[2], tuple(options), self._shape_figures(pipe, best[1]))
        return hit

    def _pipeline_figures(self, pipe: Pipeline, n_pipes: Places) -> _PipelineFigures:
        spec, ests, time, options, shape = self._priced(pipe, n_pipes)
        ms = self.cluster.machines
        share, own = [], []
        busy, upd = {}, {}
        for s, e in zip(pipe.stages, ests):
            m = s.machine
            f = len(s.devices) / ms[m].count if ms[m].gpu.shared_host else 0.0
            share.append(f)
            if f:
                busy[m] = busy.get(m, 0.0) + pipe.chunks * (e.fwd + e.bwd) * f
                upd[m] = upd.get(m, 0.0) + e.update * f
            else:
                own.append(e.update)
        (layer_tp, token), bounds, fits, peak = shape
        return _PipelineFigures(stages=ests, time=time, layer_tp=layer_tp, tp_token=token, bounds=bounds, fits=fits,
                                peak=peak,
                                machines=frozenset(s.machine for s in pipe.stages), share=tuple(share),
                                host_busy=tuple(busy.items()), host_update=tuple(upd.items()),
                                own_update=max(own, default=0.0), schedule=spec, options=options)

    def _shape_figures(self, pipe: Pipeline, ests: tuple) -> tuple:
        """((TP degree per layer, its token), stage bounds, fits, dense peak FLOP/s) of a pipeline priced as `ests`
        (kept with `_priced`'s figures). The per-layer degrees are interned, one token each, so `_dp_time` finds
        the narrowest over a layout's pipelines by their tokens (refinement estimates thousands of layouts that
        differ in one pipeline)."""
        layers = tuple(s.layers for s in pipe.stages)
        widths = tuple(len(s.devices) for s in pipe.stages)
        tokens = self._memo.setdefault("layer_tp tokens", {})
        layer_tp = tokens.get((widths, layers))
        if layer_tp is None:
            layer_tp = tokens[widths, layers] = (np.repeat(widths, layers), len(tokens))
        return (layer_tp, (0, *itertools.accumulate(layers)), all(e.memory <= e.capacity for e in ests),
                sum(s.tp * self._peak[s.machine] for s in pipe.stages))

    def dp_time(self, layout: Layout) -> float:
        """Gradient sync as the runtime does it (`cfp.runtime.executor.sync_gradients`): every stage of pipeline 0
        (which updates for all) receives its modules' gradients from every other pipeline, resharded onto its
        devices -- per layer a gather of the pipelines' pieces (the largest per-device shard among them) over the
        slowest link the layout spans -- and sums them (memory-bound); a stage syncs its layers one after
        another, stages at once, so the step waits for the slowest stage (on a shared host: for the host to do
        them all)."""
        return self._dp_time(layout, self._figures(layout))

    def _dp_time(self, layout: Layout, figs: list[_PipelineFigures]) -> float:
        n = len(layout.pipelines)
        if n == 1:
            return 0.0
        if self.features.grad_sync is not GradSync.GATHER:
            return self._collective_sync_time(layout)
        machines = frozenset().union(*(f.machines for f in figs))
        bw = self._sync_bandwidth(machines)
        machine = next(iter(machines))
        per_tp = self._sync_table(n, bw, self.kind[machine])
        tokens = ("narrowest", tuple(f.tp_token for f in figs))
        narrowest = self._memo.get(tokens)     # (TP degree per layer at its narrowest, as bytes)
        if narrowest is None:
            least = np.stack([f.layer_tp for f in figs]).min(axis=0)
            narrowest = self._memo[tokens] = (least, least.tobytes())
        pkey = (narrowest[1], n, bw, self.kind[machine])
        prefix = self._memo.get(pkey)
        if prefix is None:
            prefix = self._memo[pkey] = np.concatenate(([0.0], np.cumsum(per_tp[narrowest[0]]))).tolist()
        worst, host = 0.0, {}
        # the runtime's gather: pipeline 0's stages receive every pipeline's pieces (`sync_gradients`)
        for p, f in zip(layout.pipelines[:1], figs[:1]):
            ends = (self.kind[p.stages[0].machine], self.kind[p.stages[-1].machine])
            key = ("stage_syncs", pkey, f.bounds, ends)
            t = self._memo.get(key)
            if t is None:
                t = self._memo[key] = self._stage_syncs(prefix, f.bounds, ends, n, bw)
            if not any(f.share):
                worst = max(worst, *t)
                continue
            for st, share, ti in zip(p.stages, f.share, t):
                if share:
                    host[st.machine] = host.get(st.machine, 0.0) + ti * share
                else:
                    worst = max(worst, ti)
        return max([worst, *host.values()])

    def _stage_syncs(self, prefix: list, bounds: tuple, ends: tuple, n: int, bw: float) -> list[float]:
        """Per stage, its layers' sync (`prefix`: the layers' running sum) and the embedding's and the head's
        gradients on the first and last stage (`ends`: their machines' specs)."""
        t = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
        last = len(t) - 1
        for i in {0, last}:
            extra = ((self.model.param_bytes(Part.EMBED) if i == 0 else 0)
                     + (self.model.param_bytes(Part.HEAD) if i == last else 0))
            t[i] += self._sync_seconds(extra, n, bw, ends[0] if i == 0 else ends[1])
        return t

    def _collective_sync_time(self, layout: Layout) -> float:
        """An all-reduce or sharded sync (`StepFeatures.grad_sync`): every stage's collectives across the
        pipelines over the slowest link the layout spans, stages at once; the step waits for the slowest."""
        n = len(layout.pipelines)
        bw = self._sync_bandwidth({s.machine for p in layout.pipelines for s in p.stages})
        worst = 0.0
        for p in layout.pipelines:
            for i, st in enumerate(p.stages):
                params = self.stage_params(st, i == 0, i == len(p.stages) - 1)
                worst = max(worst, collective_sync_seconds(self.features, params, n, p.chunks,
                                                           self.model.act_bytes, bw))
        return worst

    def _sync_bandwidth(self, machines) -> float:
        """The slowest link a layout over `machines` spans: between machines, or inside its one machine."""
        if len(machines) > 1:
            return self.cluster.inter_bandwidth
        return self.cluster.machines[next(iter(machines))].intra_bandwidth

    @_memo
    def _sync_table(self, n: int, bw: float, machine: int) -> np.ndarray:
        """`_sync_seconds` of one layer's gradients by the TP degree of its shard (the index)."""
        table = np.zeros(max(m.count for m in self.cluster.machines) + 1)
        for tp in range(1, table.size):
            table[tp] = self._sync_seconds(self.model.param_bytes(Part.LAYER, tp), n, bw, machine)
        return table

    @_memo
    def _sync_seconds(self, nbytes: float, n: int, bw: float, machine: int) -> float:
        """Gather `nbytes` of gradients from each of `n` pipelines and sum them on `machine`'s devices: the sum
        is fused into the update program (`StageProgram._fused_update`), which reads the n - 1 other parts beside the
        gradient `update_time` prices."""
        return collective_time("all-gather", n * nbytes, n, bw) + self._stream_seconds(machine, (n - 1) * nbytes)

    def stages_update_time(self, stages: tuple[Stage, ...], ests: tuple[StageEstimate, ...]) -> float:
        """`update_time` of a layout of one pipeline of `stages` estimated as `ests` (without its figures)."""
        ms, own, host = self.cluster.machines, 0.0, {}
        for st, e in zip(stages, ests):
            if ms[st.machine].gpu.shared_host:
                host[st.machine] = host.get(st.machine, 0.0) + e.update * len(st.devices) / ms[st.machine].count
            else:
                own = max(own, e.update)
        return max([own, *host.values()])

    def update_time(self, layout: Layout) -> float:
        """The update reads params, gradient and optimizer state and writes params and state (`update_bytes`);
        stages update at once, the step waits for the slowest (on a shared host: for the host to do them all)."""
        return self._update_time(self._figures(layout))

    @staticmethod
    def _update_time(figs: list[_PipelineFigures]) -> float:
        return max(max(f.own_update for f in figs), *_host_sums(f.host_update for f in figs))

    def compute_time(self, layout: Layout, times: tuple[float, ...]) -> float:
        """The forward-backward part of the step: the slowest pipeline; stages on a shared host (`GpuSpec.
        shared_host`) lend their bubbles to the others, so their host takes its stages' work over its devices
        (a pipeline wholly on shared hosts is bounded by them only)."""
        return self._compute_time(self._figures(layout), times)

    @staticmethod
    def _compute_time(figs: list[_PipelineFigures], times: tuple[float, ...]) -> float:
        worst = max([t for t, f in zip(times, figs) if not all(f.share)], default=0.0)
        return max(worst, *_host_sums(f.host_busy for f in figs))

    def _figures(self, layout: Layout) -> list[_PipelineFigures]:
        n = len(layout.pipelines)      # pipeline 0 holds the optimizer state and updates for all (`Among`)
        first, other = Among(n, True), Among(n, False)
        return [self._pipeline(p, other if i else first) for i, p in enumerate(layout.pipelines)]

    def estimate(self, layout: Layout) -> Estimate:
        figs = self._figures(layout)      # once: dp, update and compute time read the same figures
        times = tuple(f.time for f in figs)
        dp, upd = self._dp_time(layout, figs), self._update_time(figs)
        step = self.features.step_seconds(self._compute_time(figs, times), dp, upd)
        seqs = layout.global_batch
        peak = sum(f.peak for f in figs)
        mfu = self.model.model_flops_per_sequence() * seqs / (step * peak)
        return Estimate(step_time=step, tokens_per_s=seqs * self.model.seq_len / step, mfu=mfu, pipeline_time=times,
                        dp_time=dp, update_time=upd, stages=tuple(f.stages for f in figs),
                        fits=all(f.fits for f in figs), peak_flops=peak, schedules=tuple(f.schedule for f in figs),
                        schedule_options=tuple(f.options for f in figs))

    def mfu_with_peaks(self, est: Estimate, layout: Layout, tflops: dict[str, float]) -> float:
        """MFU of `est` against another peak table (TFLOP/s by catalog name), e.g. a paper's."""
        used = [d for p in layout.pipelines for s in p.stages for d in s.devices]
        peak = sum(1e12 * tflops[self.cluster.machines[self._machines[d]].gpu.name] for d in used)
        return self.model.model_flops_per_sequence() * layout.global_batch / (est.step_time * peak)
