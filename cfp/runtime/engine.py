"""The training engine: heterogeneous hybrid 3D parallelism (FlashFlex/HexiScale) and Hydraulis' variable-length
mixes in one executor, for any `LayeredModel` and any optax optimizer.

A step runs a ``Layout`` of pipelines, each a list of stages, each stage its layers on a <CP,TP>
sub-mesh. ``HeteroTrainer.step(batch)`` takes either a global batch (any pytree; the pipelines' rows concatenated
in pipeline order, cut into each pipeline's ``chunks`` micro-batches) or, per pipeline, its list of micro-batches
(e.g. packed variable-length rows with segment ids; any count, any shape, none at all):

1. Every pipeline runs its schedule (GPipe, 1F1B, ZB-H1 with each backward as B then a deferred W, interleaved
   1F1B or ZB-V, whose virtual stages run as stages of their own on their stage's devices: `cfp.runtime.vstages`)
   on its micro-batches (``executor.ScheduleRun``); each stage
   accumulates the gradient of its micro-batches' summed ``loss_sum``; the step's loss is
   ``sum(loss_sum) / sum(weight)`` over every micro-batch of every pipeline.
2. Gradient sync (``executor.sync_gradients``): every stage of pipeline 0 gathers its parameters' gradients from
   every pipeline (resharded from that pipeline's stages onto this stage's shardings) and sums them in pipeline
   order.
3. The optimizer per stage of pipeline 0 (`cfp.runtime.stage.optim`): the user's optax transformation on the
   stage's part, on the summed gradient scaled by ``1 / sum(weight)``; then every other pipeline's stages get
   the new parameters from pipeline 0's (``executor.broadcast_params``), so all pipelines hold the same bits
   whatever their stage boundaries and TP degrees, and only pipeline 0 holds optimizer state. A NaN or Inf in
   the loss or a new parameter raises ``NumericalError`` naming the step and the leaf (its gradient's, when that
   is not finite; a non-finite gradient the optimizer rejects, e.g. ``optax.apply_if_finite``, is no error).

``set_layout`` switches the layout between steps (e.g. to another data mix's, `cfp.data`): the state is gathered
and placed on the new layout's stages (a copy, bit-exact). Per-action start/end times are measured by ``timing.StepClock``.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cfp.errors import ConfigError, NumericalError
from cfp.layered.model import LayeredModel, merge_stage_params, stage_params
from cfp.layout import Layout
from cfp.recompute import Recompute, resolve
from cfp.runtime.executor import (ActivationShapes, ScheduleRun, broadcast_params, check_micro_batches,
                                  device_bytes, grad_pieces, split_batch, sync_gradients)
from cfp.runtime.host_state import gather_stages, host
from cfp.runtime.stage import activations
from cfp.runtime.stage.builder import build_programs
from cfp.runtime.stage.cache import CompileCache
from cfp.runtime.stage.plans import StagePlans
from cfp.runtime.timeline import Event
from cfp.runtime.timing import StepClock
from cfp.runtime.vstages import expand, per_pipeline
from cfp.schedules.actions import KeptBytes, ScheduleTable, check_table, peak_kept
from cfp.schedules.registry import SCHEDULES, ScheduleName, ScheduleSpec, check_schedule, global_order
from cfp.schedules.simulate import ActionCosts, Simulation
from cfp.xla.compiled import compiled_memory


@dataclass
class StepStats:
    """One step: ``tokens`` the batch positions run (rows x length of its first leaf, padding included),
    ``real_tokens`` the step's total weight (its real tokens when ``last`` weighs by tokens)."""
    step: int
    loss: float
    seconds: float
    tokens: int
    real_tokens: int = 0
    events: list[Event] = field(default_factory=list)
    unmeasured: tuple = ()   # per action of this process with no measured interval (not in `events`): its stage
    kept_peak: dict = field(default_factory=dict)   # local stage -> most bytes per device of activations kept
    stage_of: Any = None     # an event's (pipeline, virtual stage) -> its (pipeline, stage); None: the same
    cpu_seconds: float = 0.0  # the process's CPU time over the step, all threads (its work, whatever else loads
    # the host: on shared cores wall time is the total work only while nothing else runs)

    def busy(self) -> dict[tuple[int, int], float]:
        """Seconds each stage (its virtual stages together) spent computing (fwd + bwd) in this step."""
        out: dict[tuple[int, int], float] = {}
        for e in self.events:
            key = (e.pipeline, e.stage) if self.stage_of is None else self.stage_of((e.pipeline, e.stage))
            out[key] = out.get(key, 0.0) + e.end - e.start
        return out


def adamw(learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
    """The zoo's default optimizer (`cfp.models.train_step`'s), for the command line's ``--lr``/``--weight-decay``."""
    return optax.adamw(learning_rate, weight_decay=weight_decay)


def zoo_trainer(model_name: str, config: Any, layout: Layout, schedule: "str | ScheduleName" = ScheduleName.GPIPE,
                *, learning_rate: float = 1e-3, weight_decay: float = 0.01, seed: int = 0, abstract: bool = False,
                **kw: Any) -> "HeteroTrainer":
    """A trainer of the zoo model ``model_name`` (its `LayeredModel`, parameters from ``seed``; ``abstract``: shapes
    only, for compiling without running) with AdamW; ``kw`` as `HeteroTrainer`'s."""
    from cfp.models.layered import zoo_model
    return HeteroTrainer(zoo_model(model_name, config, seed, abstract=abstract), adamw(learning_rate, weight_decay),
                         layout, schedule, **kw)


class HeteroTrainer:
    """Holds each local stage's parameters and optimizer state of ``model`` and runs training steps with
    ``optimizer`` on its layout (``set_layout`` switches it between steps). Its stage programs are
    built through ``cache`` (its `CompileCache`; a new one unless given: pass the one the stage-plan search
    filled, so the searched programs run as built), from ``plans`` (searched stage plans) where given, else the
    rules table on the model's logical dim names."""

    def __init__(self, model: LayeredModel, optimizer: Optional[optax.GradientTransformation], layout: Layout,
                 schedule: "str | ScheduleName" = ScheduleName.GPIPE, *, example_batch: Any = None,
                 devices: Optional[list] = None, plans: Optional[StagePlans] = None,
                 cache: Optional[CompileCache] = None, recompute: Any = Recompute.NONE):
        if cache is None:
            if optimizer is None:
                raise ConfigError("HeteroTrainer needs an optimizer or a compile cache built for one")
            cache = CompileCache(model, optimizer)
        elif cache.model is not model or (optimizer is not None and cache.tx is not optimizer):
            raise ConfigError("the compile cache holds programs of another model or optimizer")
        self.model, self.cache = model, cache
        self.tx, self.optimizer = cache.tx, cache.optimizer
        self.devices = list(devices) if devices is not None else jax.devices()
        # one schedule for every pipeline, or one per pipeline (`cfp.runtime.vstages.per_pipeline`)
        self._schedules = schedule if isinstance(schedule, (list, tuple)) else ScheduleSpec.parse(schedule)
        self.params: dict[tuple[int, int], Any] = {}
        self.opt_state: dict[tuple[int, int], Any] = {}
        self.step_count = 0
        self._initialized = False
        self._orders: dict[tuple, list] = {}
        self._tables: dict[int, ScheduleTable] = {}   # pipeline -> the table it runs in place of the pattern
        self._warmed: set = set()
        self._slicers: dict[tuple, Any] = {}
        self.warm_s = 0.0     # seconds spent in warm(): compilation kept out of timed steps
        self._example = None if example_batch is None else _like(example_batch)
        self._recompute = recompute     # one policy, or per pipeline one per stage (`cfp.recompute.resolve`)
        self._build(layout, plans)

    def _build(self, layout: Layout, plans: Optional[StagePlans] = None) -> None:
        """Programs for ``layout`` run under its pipelines' schedules: one per expanded stage (`cfp.runtime.vstages`)."""
        layout.validate_for(self.model.num_layers, len(self.devices), self.model.heads)
        specs = per_pipeline(self._schedules, len(layout.pipelines))
        self.layout, self.vstages = layout, expand(layout, specs)
        self.run_layout = self.vstages.run
        policies = resolve(self._recompute, [p.num_stages for p in layout.pipelines])
        self.recompute = policies
        stage_policy = lambda key: policies[self.vstages.stage_of(key)[0]][self.vstages.stage_of(key)[1]]
        self.programs = build_programs(self.run_layout, self.devices, self.cache, plans, self._example, stage_policy)
        self._local = {k: pr for k, pr in self.programs.items() if pr.is_local}
        self._clock = StepClock({k: pr.stage.devices for k, pr in self._local.items()})
        self._act_shape = ActivationShapes(self.run_layout, self.programs)
        self._use_schedule(specs, self.vstages)

    @property
    def spec(self) -> ScheduleSpec:
        """Pipeline 0's schedule (`specs`: every pipeline's)."""
        return self.specs[0]

    @property
    def schedule(self) -> ScheduleName:
        return self.spec.name

    def spec_of(self, pipeline: int) -> ScheduleSpec:
        return self.specs[pipeline]

    def set_layout(self, layout: Layout) -> bool:
        """Switch to another layout between steps: the state is gathered from the current stages and placed on
        the new layout's (values copied, unchanged). Returns whether the layout changed."""
        if layout == self.layout:
            return False
        self._rebuild(layout, self._schedules)
        return True

    def _rebuild(self, layout: Layout, schedules: Any) -> None:
        """Programs for ``layout`` under ``schedules``, the state moved onto them (values copied, unchanged)."""
        state = self.state() if self._initialized else None
        self._schedules, self.params, self.opt_state = schedules, {}, {}
        self._build(layout)
        if state is not None:
            self.load_state(*state)

    # ------------------------------------------------------------------ state
    def init(self) -> "HeteroTrainer":
        """Start from the model's parameters and the optimizer's initial state on them."""
        params = host(self.model.params)
        return self.load_state(params, jax.jit(self.tx.init)(params), 0)

    def load_state(self, params: Any, opt_state: Any, step: int) -> "HeteroTrainer":
        """Place a layout-independent state (the model's full parameter tree and its optax state)."""
        params, opt_state = host(params), host(opt_state)
        m = self.model
        for key, prog in self._local.items():
            st = prog.stage
            mine = stage_params(params, st.layer_start, st.layer_end, st.is_first, st.is_last, m.stacked)
            self.params[key] = prog.place_params(mine)
            if st.pipeline == 0:        # pipeline 0 updates for all: the others hold no optimizer state
                self.opt_state[key] = prog.place_opt_state(prog.optimizer.cut(opt_state))
        self.step_count = int(step)
        self._initialized = True
        return self

    def state(self) -> tuple[Any, Any, int]:
        """The layout-independent state as host numpy trees: (params, opt_state, step), taken from pipeline 0
        (all pipelines hold identical values); in a multi-process run stages held elsewhere are broadcast."""
        keys = [st.key for st in self.run_layout.placed_in(0)]
        local = lambda k: self.programs[k].is_local
        params = gather_stages(keys, self.params, lambda k: self.programs[k].params_like, local)
        opts = gather_stages(keys, self.opt_state, lambda k: self.programs[k].optimizer.like, local)
        full, opt = self.optimizer.merge(params, opts, self.run_layout.placed_in(0))
        return full, opt, self.step_count

    def compile_jobs(self, key: tuple[int, int], batch_like: Optional[Any] = None, split: bool = False) -> list:
        """``(jitted program, abstract arguments)`` of stage ``key``'s fwd, bwd, zeros and update (``split``: and
        its B and W), for micro-batches shaped like ``batch_like`` (default: the model's example batch cut to the
        micro-batch)."""
        prog = self.programs[key]
        st = prog.stage
        b = batch_like if batch_like is not None else self.micro_batch_like(key[0])
        x_like = None if st.is_first else self._act_shape((key[0], key[1] - 1), b)
        y_like = None if st.is_last else self._act_shape(key, b)
        return prog.compile_jobs(x_like, b if (st.is_first or st.is_last) else None, y_like,
                                 grad_pieces(self.run_layout, st), split)

    def micro_batch_like(self, pipeline: int) -> Any:
        """ShapeDtypeStructs of pipeline ``pipeline``'s micro-batch, from the example batch the trainer was
        given."""
        if self._example is None:
            raise ConfigError("compiling ahead of time needs the trainer's example_batch (the batches' shapes)")
        rows = self.run_layout.pipelines[pipeline].micro_batch
        return jax.tree_util.tree_map(lambda l: jax.ShapeDtypeStruct((rows,) + tuple(l.shape[1:]), l.dtype),
                                      self._example)

    def compile(self, workers: Optional[int] = None) -> float:
        """Compile every local stage program ahead of time, several at once (XLA compiles outside the GIL); the
        first step then only traces. Returns the seconds it took."""
        t0 = time.perf_counter()
        # the other pipelines' stages take pipeline 0's new parameters: they compile no update
        jobs = [job for key, prog in self._local.items()
                for job in self.compile_jobs(key, split=self.specs[key[0]].entry.split)
                if key[0] == 0 or job[0] is not prog.fused_update]
        with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            list(pool.map(lambda j: j[0].lower(*j[1]).compile(), jobs))
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ one step
    def set_schedule(self, schedule: "str | ScheduleName | ScheduleSpec") -> None:
        """Switch the schedule (one the runtime runs: `Schedule.runs_on_engine`; ``interleaved:V`` gives its
        virtual stages). Between schedules of the same virtual stages the forward and whole-backward programs
        stay, B and W compile on first use; another placement of virtual stages rebuilds the programs and
        places the state on them (values copied, unchanged)."""
        request = schedule if isinstance(schedule, (list, tuple)) else ScheduleSpec.parse(schedule)
        specs = per_pipeline(request, len(self.layout.pipelines))
        vstages = expand(self.layout, specs)
        if vstages.run != self.run_layout:
            searched = sorted(k for k, pr in self.programs.items() if pr.replay is not None)
            if searched:
                raise ConfigError(f"schedule {_specs_text(specs)} runs other virtual stages than "
                                  f"{_specs_text(self.specs)}, but stage(s) {searched} run searched stage plans, "
                                  "which are per stage")
            return self._rebuild(self.layout, request)
        self._schedules = request
        self._use_schedule(specs, vstages)

    def _use_schedule(self, specs: tuple[ScheduleSpec, ...], vstages) -> None:
        """Run pipeline q under ``specs[q]`` on the programs built for their virtual stages ``vstages``."""
        self.specs, self.vstages = tuple(specs), vstages
        self._tables, self._orders = {}, {}
        self.order = self._order([p.chunks for p in self.layout.pipelines])

    def table(self, pipeline: int, microbatches: Optional[int] = None) -> ScheduleTable:
        """The table ``pipeline`` runs for ``microbatches`` (default: its layout's chunks): the one `use_tables` gave
        it for that many, else its schedule's fixed pattern."""
        m = self.layout.pipelines[pipeline].chunks if microbatches is None else microbatches
        given = self._tables.get(pipeline)
        if given is not None and given.microbatches == m:
            return given
        return self.pattern(pipeline, m)

    def pattern(self, pipeline: int, microbatches: Optional[int] = None) -> ScheduleTable:
        """The schedule's fixed pattern for ``pipeline`` and ``microbatches`` (default: its layout's chunks)."""
        m = self.layout.pipelines[pipeline].chunks if microbatches is None else microbatches
        spec = self.specs[pipeline]
        return spec.entry(self.layout.pipelines[pipeline].num_stages, m, spec.v)

    def use_tables(self, tables: dict[int, ScheduleTable]) -> None:
        """Run each given pipeline's micro-batches by its table from the next step on (until the schedule or the
        layout changes), in place of the fixed pattern: a table of this schedule's virtual stages, validated here
        (every action once, no deadlock, within the memory the pattern keeps per device)."""
        for p, t in tables.items():
            pattern = self.pattern(p, t.microbatches)
            if t.placement != pattern.placement or t.split != pattern.split:
                raise ConfigError(f"a table for pipeline {p} places its virtual stages {t.placement} and "
                                  f"{'splits' if t.split else 'does not split'} the backward; schedule "
                                  f"{self.specs[p]} "
                                  f"places them {pattern.placement} and {'splits' if pattern.split else 'does not'}")
            kept = self.kept_bytes(p)
            check_table(t, peak_kept(pattern, kept), kept)
        self._tables, self._orders = {**self._tables, **tables}, {}
        self.order = self._order([p.chunks for p in self.layout.pipelines])

    def generated_tables(self, costs: dict[int, ActionCosts]) -> dict[int, tuple[ScheduleTable, Simulation]]:
        """Per pipeline given its virtual stages' F, B and W seconds, the shortest table the generator builds for
        its chunks (`Schedule.generated`) within the activation bytes per device the fixed pattern keeps, and its
        simulation."""
        out = {}
        for p, c in costs.items():
            pipe = self.layout.pipelines[p]
            kept = self.kept_bytes(p)
            pattern = self.pattern(p)
            spec = self.specs[p]
            out[p] = spec.entry.generated(pipe.num_stages, pipe.chunks, c, spec.v,
                                               peak_kept(pattern, kept), kept)
        return out

    def _order(self, chunks: list[int]) -> list:
        """The global action order of the pipelines with ``chunks[p]`` micro-batches (cached)."""
        key = (self.specs, tuple(p.num_stages for p in self.layout.pipelines), tuple(chunks))
        if key not in self._orders:
            per_pipe = []
            for q, m in enumerate(chunks):
                acts = self.table(q, m)
                if m:   # a pipeline given no micro-batches this step runs nothing
                    check_schedule(acts, m)
                per_pipe.append(acts)
            # the dispatcher runs virtual stage c as expanded stage c (its own program)
            self._orders[key] = [a._replace(stage=a.vstage) for a in global_order(per_pipe)]
        return self._orders[key]

    def micro_batches(self, batch: Any) -> list[list[Any]]:
        """Per pipeline its micro-batches: a global batch (a pytree) is cut by the layout's batch sizes; a list
        (one list of micro-batches per pipeline) is checked and taken as is."""
        if isinstance(batch, list):
            return check_micro_batches(self.run_layout, batch)
        return split_batch(self.run_layout, batch)

    def step(self, batch: Any) -> StepStats:
        """One optimizer step on a global batch or on per-pipeline micro-batch lists (see ``micro_batches``)."""
        t_start, cpu_start = time.perf_counter(), time.process_time()
        mbs = self.micro_batches(batch)
        acc, loss, weight, order, kept_peak = self._run_schedule(mbs)
        _check_loss(loss, self.step_count + 1)
        parts = sync_gradients(self.run_layout, self.programs, acc, self._slice)
        scale = np.float32(1.0) / np.float32(weight)
        grads = {key: self.programs[key].gradient(g, scale) for key, g in parts.items()}
        globals_ = self._globals(grads)
        flags = {}
        for key, g in grads.items():
            self.params[key], self.opt_state[key], flags[key] = self.programs[key].apply_update(
                g, self.opt_state[key], self.params[key], globals_)
        broadcast_params(self.run_layout, self.programs, self.params, self._slice,
                         lambda key, pieces: self.programs[key].join_layers(pieces))
        jax.block_until_ready(list(self.params.values()))
        seconds, cpu_seconds = time.perf_counter() - t_start, time.process_time() - cpu_start
        self._check_finite(flags)
        self.step_count += 1
        flat = [mb for p in mbs for mb in p]
        slots = sum(int(np.prod(np.shape(jax.tree_util.tree_leaves(mb)[0])[:2])) for mb in flat)
        events = self._clock.events(order, t_start)
        return StepStats(step=self.step_count, loss=loss, seconds=seconds, tokens=slots,
                         real_tokens=int(round(weight)), events=events, unmeasured=tuple(self._clock.unmeasured),
                         kept_peak=kept_peak, stage_of=self.vstages.stage_of, cpu_seconds=cpu_seconds)

    def _globals(self, grads: dict) -> dict:
        """The optimizer's values taken over every stage (e.g. a global gradient norm), exchanged round by round
        from pipeline 0's stages (every stage of every pipeline then gets the same ones); {} when the optimizer
        needs none."""
        glob: dict = {}
        keys = [st.key for st in self.run_layout.placed_in(0)]
        local = lambda k: self.programs[k].is_local
        for r in range(self.optimizer.rounds):
            mine = {k: self.programs[k].optimizer.partials(r, grads[k], self.opt_state[k], self.params[k], glob)
                    for k in keys if local(k)}
            got = gather_stages(keys, mine, lambda k: self.programs[k].optimizer.partials_like(r), local)
            glob = self.optimizer.combine(r, got, glob)
        return glob

    def _slice(self, key: tuple[int, int], layers: Any, start: int, stop: int) -> Any:
        """A stage's layer gradients cut to its local layers ``start .. stop-1`` (a jitted slice of stacked
        leaves, once per range; list slicing otherwise)."""
        n = self.programs[key].stage.stage.layers
        if start == 0 and stop == n:
            return layers
        if not self.model.stacked:
            return list(layers[start:stop])
        k = (start, stop)
        if k not in self._slicers:
            self._slicers[k] = jax.jit(lambda t: jax.tree_util.tree_map(lambda a: a[start:stop], t))
        return self._slicers[k](layers)

    def gradients(self, batch: Any) -> tuple[Any, float]:
        """(full gradient tree of the step's loss as numpy, loss) at the current parameters (from pipeline 0's
        stages: every pipeline's stage sums the same gradients)."""
        acc, loss, weight, order, _ = self._run_schedule(self.micro_batches(batch))
        self._clock.events(order, 0.0)  # drain the watchers
        parts = sync_gradients(self.run_layout, self.programs, acc, self._slice)
        scale = np.float32(1.0) / np.float32(weight)
        summed = {k: self.programs[k].gradient(parts[k], scale) for k in parts}
        keys = [st.key for st in self.run_layout.placed_in(0)]
        trees = gather_stages(keys, summed, lambda k: self.programs[k].params_like,
                              lambda k: self.programs[k].is_local)
        return merge_stage_params(trees, self.model.stacked), loss

    def warm(self, batch: Any) -> float:
        """Run (and discard) one micro-batch of each shape in ``batch`` that this layout's pipelines have not run
        yet, and the stage updates on a copy of the state, so that a following ``step`` does not compile. The
        state is unchanged. Returns the seconds it took."""
        t0 = time.perf_counter()
        mbs = self.micro_batches(batch)
        todo: list[list[Any]] = [[] for _ in mbs]
        for p, pipe_mbs in enumerate(mbs):
            for mb in pipe_mbs:
                sig = jax.tree_util.tree_map(np.shape, mb)
                # keyed by the layout, not the pipeline's stages: the same stages in another layout sync their
                # gradients with other pipelines, programs of their own (measured: a step compiling them, 3-4 s)
                key = (self.run_layout, p, str(jax.tree_util.tree_structure(mb)),
                       tuple(jax.tree_util.tree_leaves(sig)))
                if key not in self._warmed:
                    self._warmed.add(key)
                    todo[p].append(mb)
        if any(todo):
            acc, _, _, order, _ = self._run_schedule(todo)
            jax.block_until_ready(acc)
            self._clock.events(order, 0.0)  # drain the watchers
        if ("update", self.run_layout) not in self._warmed:
            self._warmed.add(("update", self.run_layout))
            for key, prog in self._local.items():
                if key[0] != 0:
                    continue
                copy = jax.tree_util.tree_map(jnp.copy, (self.params[key], self.opt_state[key]))
                parts = [prog.grad_parts_zeros(p) for p in grad_pieces(self.run_layout, prog.stage)]
                g = prog.gradient(parts, np.float32(1.0))
                glob = {v: jnp.zeros(l.shape, l.dtype) for v, l in self.optimizer.globals_like.items()}
                jax.block_until_ready(prog.apply_update(g, copy[1], copy[0], glob))
            # the step's transfers too (gradient sync, parameter broadcast): their first use builds programs,
            # which a step would time; the broadcast writes into a copy of the dict, the state is unchanged
            if any(todo):
                jax.block_until_ready(sync_gradients(self.run_layout, self.programs, acc, self._slice))
            shadow = dict(self.params)
            broadcast_params(self.run_layout, self.programs, shadow, self._slice,
                             lambda key, pieces: self.programs[key].join_layers(pieces))
            jax.block_until_ready(list(shadow.values()))
        dt = time.perf_counter() - t0
        self.warm_s += dt
        return dt

    def forward_backward(self, batch: Any) -> float:
        """The step's schedule without the update (accumulated gradients discarded); the loss. For timing a
        layout on a micro-batch (the scheme-space fits)."""
        acc, loss, _, order, _ = self._run_schedule(self.micro_batches(batch))
        jax.block_until_ready(acc)
        self._clock.events(order, 0.0)
        return loss

    def measure(self, batch: Any, serial: bool = False) -> list[Event]:
        """One pass of the schedule on ``batch`` without the update (gradients discarded, state unchanged): each
        action's measured interval, from the pass's start (as a step's `StepStats.events`). ``serial``: one action
        at a time (`ScheduleRun`), so that stages sharing cores do not lengthen each other's measured times."""
        t0 = time.perf_counter()
        acc, _, _, order, _ = self._run_schedule(self.micro_batches(batch), serial)
        jax.block_until_ready(acc)
        return self._clock.events(order, t0)

    def stage_memory(self, batch_like: Any) -> list:
        """Per-device bytes (`compiled_memory`: arguments + outputs + temporaries) of every local stage's backward
        program (its arguments hold the residuals its forward kept, under the stage's recompute policy) on
        micro-batches shaped like ``batch_like``."""
        out = []
        for key in self._local:
            fn, args = self.compile_jobs(key, batch_like)[1]
            out.append(compiled_memory(fn.lower(*args).compile()))
        return out

    def _run_schedule(self, mbs: list[list[Any]], serial: bool = False) -> tuple[dict, float, float, list, dict]:
        """(accumulated gradients, loss, total weight, global action order, per local stage the most activation
        bytes per device kept between actions); ``serial``: one action at a time (`ScheduleRun`)."""
        if not self._initialized:
            raise ConfigError("HeteroTrainer.step called before init() or load_state()")
        order = self._order([len(p) for p in mbs])
        run = ScheduleRun(self.run_layout, self.programs, self.params, order, self._act_shape, self._clock,
                          self.vstages.stage_of, serial)
        acc, loss, weight = run.run(mbs)
        return acc, loss, weight, order, run.memory.peak

    def kept_bytes(self, pipeline: int, batch_like: Optional[Any] = None) -> KeptBytes:
        """Per virtual stage of ``pipeline``, the bytes per device one micro-batch shaped like ``batch_like``
        (default: the example batch's) keeps on its stage: its input from F to its backward and, with B and W
        split, B's input and output gradient from B to W."""
        b = batch_like if batch_like is not None else self.micro_batch_like(pipeline)
        ins, weight = [], []
        n = self.run_layout.pipelines[pipeline].num_stages
        for c in range(n):
            prog = self.programs[(pipeline, c)]
            x = None if c == 0 else self._act_shape((pipeline, c - 1), b)
            y = None if c == n - 1 else self._act_shape((pipeline, c), b)
            st = prog.stage
            kept, w_kept = prog.kept_like(x, b if (st.is_first or st.is_last) else None, y)
            ins.append(device_bytes(kept))
            weight.append(device_bytes(w_kept))
        return KeptBytes(tuple(float(i) for i in ins), tuple(float(w) for w in weight))

    def kept_prediction(self, batch_like: Optional[Any] = None) -> dict[tuple[int, int], int]:
        """Per local stage (of the layout: its virtual stages together), the most bytes per device of micro-batch
        activations its schedule keeps at once (`peak_kept` of the table its pipeline runs, with `kept_bytes`),
        for micro-batches shaped like ``batch_like`` but with each pipeline's own micro-batch rows (default: the
        example batch's); what a step's `StepStats.kept_peak` must not exceed."""
        out = {}
        local = {self.vstages.stage_of(k) for k in self._local}
        for p, pipe in enumerate(self.run_layout.pipelines):
            rows = lambda l: jax.ShapeDtypeStruct((pipe.micro_batch,) + tuple(l.shape[1:]), l.dtype)
            kept = self.kept_bytes(p, None if batch_like is None else jax.tree_util.tree_map(rows, batch_like))
            for s, peak in enumerate(peak_kept(self.table(p), kept)):
                if (p, s) in local:
                    out[(p, s)] = int(peak)
        return out

    def _check_finite(self, flags: dict) -> None:
        """Raise NumericalError naming the first stage leaf whose gradient or new value is not finite, when a new
        value is not: a non-finite gradient the user's optimizer rejected (``optax.apply_if_finite``,
        ``MultiSteps``' ``skip_not_finite``, ``zero_nans``) leaves the parameters finite, as on one device."""
        for key in sorted(flags):
            ok = np.asarray(flags[key])
            if ok[1].all():
                continue
            st = self.programs[key].stage
            names = [_global_name(jax.tree_util.keystr(p), st.layer_start, self.model.stacked) for p, _ in
                     jax.tree_util.tree_flatten_with_path(self.programs[key].params_like)[0]]
            what, leaf = ("gradient", int(np.argmin(ok[0]))) if not ok[0].all() else (
                "parameter after the update", int(np.argmin(ok[1])))
            raise NumericalError(f"step {self.step_count + 1}: {what} of {names[leaf]} (stage {key}) "
                                 f"is NaN or Inf")


def _global_name(path: str, layer_start: int, stacked: bool) -> str:
    """A stage's parameter path as the model's: list-form layer indices are the stage's own (from 0)."""
    if stacked or not path.startswith("['layers']["):
        return path
    i = path.index("]", len("['layers']["))
    return f"['layers'][{int(path[len("['layers']["):i]) + layer_start}]" + path[i + 1:]


def _like(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _check_loss(loss: float, step: int) -> None:
    if not np.isfinite(loss):
        raise NumericalError(f"step {step}: loss is {loss}")


def _specs_text(specs: tuple) -> str:
    """One schedule, or each pipeline's."""
    return str(specs[0]) if len(set(specs)) == 1 else ", ".join(f"{s} (pipeline {q})" for q, s in enumerate(specs))
