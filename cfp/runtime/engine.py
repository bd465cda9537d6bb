"""The training engine: heterogeneous hybrid 3D parallelism (FlashFlex/HexiScale) and Hydraulis'
variable-length strategies in one executor.

A step runs a *strategy*: a ``Layout`` of pipelines, each a list of stages, each stage its layers
on a <CP,TP> sub-mesh.  ``HeteroTrainer.step(batch)`` takes either a fixed-length global batch (the
pipelines' rows concatenated in pipeline order, cut into each pipeline's ``chunks`` micro-batches) or,
per pipeline, its list of micro-batches (packed variable-length rows with segment ids and restarting
positions; any count, any shape, none at all):

1. Every pipeline runs its schedule (GPipe / 1F1B) on its micro-batches (``dispatch.ScheduleRun``);
   each stage accumulates its gradient over its micro-batches.  Every micro-batch's loss term is its
   token-weighted share of the whole step's loss.
2. Gradient sync (``dispatch.sync_gradients``): for every stage of every pipeline, each of its
   submodules' gradients is gathered from every pipeline (resharded from that pipeline's stage onto
   this stage's shardings) and summed in pipeline order -- the same elementwise sums everywhere, so
   all pipelines keep bit-identical parameters.
3. AdamW (optax) per stage.  AdamW is elementwise, so per-stage optimizers equal one global optimizer.
   A NaN or Inf in the loss, a summed gradient or a new parameter raises ``NumericalError`` naming
   the step and the leaf.

``set_layout`` switches the strategy between steps: the state is gathered and placed on the new
layout's stages (a copy, bit-exact).  Per-action start/end times are measured by ``timing.StepClock``.
"""
from __future__ import annotations

import functools
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
from cfp.models import init_params
from cfp.runtime.dispatch import (ActivationShapes, ScheduleRun, check_micro_batches, split_batch,
                                  sync_gradients)
from cfp.layout import Layout
from cfp.runtime.schedules import SCHEDULES, ScheduleName, check_schedule, global_order
from cfp.runtime.stage.build import build_programs
from cfp.runtime.stage.cache import CompileCache
from cfp.runtime.stage.plans import StagePlans
from cfp.runtime.state import collect, first_wins, path_table, place_opt_state, subtree
from cfp.runtime.timeline import Event
from cfp.runtime.timing import StepClock
from cfp.xla.compiled import compiled_memory


@dataclass
class StepStats:
    """One step: ``tokens`` the token slots run (padding included), ``real_tokens`` those with a
    non-zero loss weight."""
    step: int
    loss: float
    seconds: float
    tokens: int
    real_tokens: int = 0
    events: list[Event] = field(default_factory=list)
    unmeasured: tuple = ()   # per action of this process with no measured interval (not in `events`): its stage

    def busy(self) -> dict[tuple[int, int], float]:
        """Seconds each stage spent computing (fwd + bwd) in this step."""
        out: dict[tuple[int, int], float] = {}
        for e in self.events:
            out[(e.pipeline, e.stage)] = out.get((e.pipeline, e.stage), 0.0) + e.end - e.start
        return out


def optimizer(learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
    """The optimizer of ``cfp.models.train_step`` (AdamW), so the single-device replay matches."""
    return optax.adamw(learning_rate, weight_decay=weight_decay)


def compile_cache(learning_rate: float, weight_decay: float) -> CompileCache:
    """An empty compile cache for the AdamW optimizer of these hyper-parameters."""
    return CompileCache(optimizer(learning_rate, weight_decay), (float(learning_rate), float(weight_decay)))


class HeteroTrainer:
    """Holds each local stage's params and optimizer state and runs training steps on its layout (the
    strategy; ``set_layout`` switches it between steps). Its stage programs are built through ``cache``
    (its `CompileCache`; a new one unless given: pass the one the stage-plan search filled, so the searched
    programs run as built), from ``plans`` (searched stage plans) where given, else the Megatron rules."""

    def __init__(self, model_name: str, config: Any, layout: Layout,
                 schedule: "str | ScheduleName" = ScheduleName.GPIPE, *, learning_rate: float = 1e-3,
                 weight_decay: float = 0.01, devices: Optional[list] = None,
                 plans: Optional[StagePlans] = None, cache: Optional[CompileCache] = None):
        self.model_name, self.config = model_name, config
        self.devices = list(devices) if devices is not None else jax.devices()
        self.cache = cache if cache is not None else compile_cache(learning_rate, weight_decay)
        if self.cache.tx_key != (float(learning_rate), float(weight_decay)):
            raise ConfigError(f"the compile cache holds programs of learning rate, weight decay "
                              f"{self.cache.tx_key}, not ({learning_rate}, {weight_decay})")
        self.tx = self.cache.tx
        self.full_like = jax.eval_shape(lambda: init_params(model_name, config, 0))
        self.schedule = ScheduleName.parse(schedule)
        self.aux_coef = float(getattr(config, "aux_loss_coef", 0.0))
        self.params: dict[tuple[int, int], Any] = {}
        self.opt_state: dict[tuple[int, int], Any] = {}
        self.step_count = 0
        self._initialized = False
        self._orders: dict[tuple, list] = {}
        self._warmed: set = set()
        self.warm_s = 0.0     # seconds spent in warm(): compilation kept out of timed steps
        self._build(layout, plans)

    def _build(self, layout: Layout, plans: Optional[StagePlans] = None) -> None:
        layout.validate_for(self.config, len(self.devices))
        self.layout = layout
        self.programs = build_programs(self.model_name, self.config, layout, self.devices, self.cache, plans)
        self.set_schedule(self.schedule)
        self._local = {k: pr for k, pr in self.programs.items() if pr.is_local}
        self._clock = StepClock({k: pr.stage.devices for k, pr in self._local.items()})
        self._act_shape = ActivationShapes(layout, self.programs, self.config.seq_len)

    def set_layout(self, layout: Layout) -> bool:
        """Switch to another strategy between steps: the state is gathered from the current stages and
        placed on the new layout's (values copied, unchanged).  Returns whether the layout changed."""
        if layout == self.layout:
            return False
        state = self.state() if self._initialized else None
        self.params, self.opt_state = {}, {}
        self._build(layout)
        if state is not None:
            self.load_state(*state)
        return True

    # ------------------------------------------------------------------ state
    def init(self, seed: int = 0) -> "HeteroTrainer":
        """Initialise exactly like ``cfp.models.train_step(...).init(seed)``."""
        params = init_params(self.model_name, self.config, seed)
        return self.load_state(params, self.tx.init(params), 0)

    def load_state(self, params: Any, opt_state: Any, step: int) -> "HeteroTrainer":
        """Place a layout-independent state (full ``{"params": ...}`` tree + its optax state)."""
        for key, prog in self._local.items():
            self.params[key] = prog.place_params(subtree(params, prog.stage.module_names()))
            self.opt_state[key] = place_opt_state(opt_state, prog.opt_shardings)
        self.step_count = int(step)
        self._initialized = True
        return self

    def state(self) -> tuple[Any, Any, int]:
        """The layout-independent state as host numpy trees: (params, opt_state, step).

        Every module is taken from the lowest-numbered pipeline holding it on this process (all
        pipelines hold identical values).  In a multi-process run modules held only elsewhere are
        fetched with a cross-process all-gather.
        """
        keys = sorted(self.params)
        params = collect(self.full_like, first_wins(path_table(self.params[k]) for k in keys))
        opt_like = jax.eval_shape(self.tx.init, self.full_like)
        opt = collect(opt_like, first_wins(path_table(self.opt_state[k]) for k in keys))
        return params, opt, self.step_count

    def compile_jobs(self, key: tuple[int, int]) -> list:
        """``(jitted program, abstract arguments)`` of stage ``key``'s fwd, bwd, zeros and update."""
        prog, pipe = self.programs[key], self.layout.pipelines[key[0]]
        x_like = None if prog.stage.is_first else self._act_shape((key[0], key[1] - 1))
        y_like = None if prog.stage.is_last else self._act_shape(key)
        return prog.compile_jobs(pipe.micro_batch, self.config.seq_len, x_like, y_like,
                                 len(self.layout.pipelines))

    def compile(self, workers: Optional[int] = None) -> float:
        """Compile every local stage program ahead of time, several at once (XLA compiles outside
        the GIL); the first step then only traces.  Returns the seconds it took."""
        t0 = time.perf_counter()
        jobs = [job for key in self._local for job in self.compile_jobs(key)]
        with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            list(pool.map(lambda j: j[0].lower(*j[1]).compile(), jobs))
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ one step
    def set_schedule(self, schedule: "str | ScheduleName") -> None:
        """Switch GPipe/1F1B; compiled stage programs do not depend on the schedule."""
        self.schedule = ScheduleName.parse(schedule)
        self.order = self._order([p.chunks for p in self.layout.pipelines])

    def _order(self, chunks: list[int]) -> list:
        """The global action order of the pipelines with ``chunks[p]`` micro-batches (cached)."""
        key = (self.schedule, tuple(p.num_stages for p in self.layout.pipelines), tuple(chunks))
        if key not in self._orders:
            per_pipe = []
            for p, m in zip(self.layout.pipelines, chunks):
                acts = SCHEDULES[self.schedule](p.num_stages, m)
                check_schedule(acts, m)
                per_pipe.append(acts)
            self._orders[key] = global_order(per_pipe)
        return self._orders[key]

    def micro_batches(self, batch: Any) -> list[list[dict]]:
        """Per pipeline its micro-batches: a fixed-length global batch dict is cut by the layout's batch
        sizes; a list (one list of micro-batch dicts per pipeline) is checked and taken as is."""
        if isinstance(batch, dict):
            return split_batch(self.layout, batch)
        return check_micro_batches(self.layout, batch)

    def step(self, batch: Any) -> StepStats:
        """One optimizer step on a fixed-length global batch ``{"inputs", "targets", "weights"}``
        [B_total, S] or on per-pipeline micro-batch lists (see ``micro_batches``)."""
        t_start = time.perf_counter()
        mbs = self.micro_batches(batch)
        acc, loss, order = self._run_schedule(mbs)
        _check_loss(loss, self.step_count + 1)
        flags = {}
        for key, g in sync_gradients(self.layout, self.programs, acc).items():
            self.params[key], self.opt_state[key], flags[key] = self.programs[key].update(
                self.params[key], self.opt_state[key], g)
        jax.block_until_ready(list(self.params.values()))
        seconds = time.perf_counter() - t_start
        self._check_finite(flags)
        self.step_count += 1
        flat = [mb for p in mbs for mb in p]
        slots = sum(int(mb["inputs"].size) for mb in flat)
        real = sum(int(np.count_nonzero(mb["weights"])) for mb in flat)
        events = self._clock.events(order, t_start)
        return StepStats(self.step_count, loss, seconds, slots, real, events, tuple(self._clock.unmeasured))

    def gradients(self, batch: dict) -> tuple[Any, float]:
        """(full gradient tree as numpy, loss) of the global batch at the current parameters."""
        acc, loss, order = self._run_schedule(self.micro_batches(batch))
        self._clock.events(order, 0.0)  # drain the watchers
        # summed on the host: the same elementwise float32 adds in the same order, no compile
        summed = {}
        for k, parts in sync_gradients(self.layout, self.programs, acc).items():
            host = [jax.tree_util.tree_map(np.asarray, t) for t in parts]
            summed[k] = functools.reduce(lambda a, b: jax.tree_util.tree_map(np.add, a, b), host)
        grads = collect(self.full_like, first_wins(path_table(summed[k]) for k in sorted(summed)))
        return grads, loss

    def warm(self, batch: Any) -> float:
        """Run (and discard) one micro-batch of each shape in ``batch`` that this layout's pipelines have
        not run yet, and the stage updates on a copy of the state, so that a following ``step`` does not
        compile.  The state is unchanged.  Returns the seconds it took."""
        t0 = time.perf_counter()
        mbs = self.micro_batches(batch)
        todo: list[list[dict]] = [[] for _ in mbs]
        for p, pipe_mbs in enumerate(mbs):
            for mb in pipe_mbs:
                key = (self.layout.pipelines[p].stages, mb["inputs"].shape, "segment_ids" in mb)
                if key not in self._warmed:
                    self._warmed.add(key)
                    todo[p].append(mb)
        if any(todo):
            acc, _, order = self._run_schedule(todo)
            jax.block_until_ready(acc)
            self._clock.events(order, 0.0)  # drain the watchers
        if ("update", self.layout) not in self._warmed:
            self._warmed.add(("update", self.layout))
            # the gradient sync's transfers too: their first use builds programs, which a step would time
            synced = sync_gradients(self.layout, self.programs, {k: p.zeros() for k, p in self._local.items()})
            for key, prog in self._local.items():
                copy = jax.tree_util.tree_map(jnp.copy, (self.params[key], self.opt_state[key]))
                jax.block_until_ready(prog.update(*copy, synced[key]))
        dt = time.perf_counter() - t0
        self.warm_s += dt
        return dt

    def forward_backward(self, batch: Any) -> float:
        """The step's schedule without the update (accumulated gradients discarded); the loss.  For
        timing a layout on a micro-batch (the scheme-space fits)."""
        acc, loss, order = self._run_schedule(self.micro_batches(batch))
        jax.block_until_ready(acc)
        self._clock.events(order, 0.0)
        return loss

    def stage_memory(self, shape: tuple[int, int], packed: bool = True) -> list:
        """Per-device bytes (`compiled_memory`: arguments + outputs + temporaries) of every local stage's
        backward program (which recomputes its forward) on micro-batches of ``shape`` [rows, seq]."""
        out = []
        for key, prog in self._local.items():
            pipe = self.layout.pipelines[key[0]]
            x_like = None if prog.stage.is_first else self._act_shape(
                (key[0], key[1] - 1), shape, packed)
            y_like = None if prog.stage.is_last else self._act_shape(key, shape, packed)
            fn, args = prog.compile_jobs(shape[0], shape[1], x_like, y_like, 1)[1]
            tok = jax.ShapeDtypeStruct(tuple(shape), jnp.int32, sharding=prog.rows)
            kw = {"packed": (tok, tok)} if packed else {}
            out.append(compiled_memory(fn.lower(*args, **kw).compile()))
        return out

    def _run_schedule(self, mbs: list[list[dict]]) -> tuple[dict, float, list]:
        if not self._initialized:
            raise ConfigError("HeteroTrainer.step called before init() or load_state()")
        order = self._order([len(p) for p in mbs])
        run = ScheduleRun(self.layout, self.programs, self.params, order, self.aux_coef,
                          self._act_shape, self._clock)
        acc, loss = run.run(mbs)
        return acc, loss, order

    def _check_finite(self, flags: dict) -> None:
        """Raise NumericalError naming the first stage leaf whose gradient or new value is not finite."""
        for key in sorted(flags):
            ok = np.asarray(flags[key])
            if ok.all():
                continue
            names = [jax.tree_util.keystr(p) for p, _ in
                     jax.tree_util.tree_flatten_with_path(self.programs[key].params_like)[0]]
            what, leaf = ("gradient", int(np.argmin(ok[0]))) if not ok[0].all() else (
                "parameter after the update", int(np.argmin(ok[1])))
            raise NumericalError(f"step {self.step_count + 1}: {what} of {names[leaf]} (stage {key}) "
                                 f"is NaN or Inf")


def _check_loss(loss: float, step: int) -> None:
    if not np.isfinite(loss):
        raise NumericalError(f"step {step}: loss is {loss}")
