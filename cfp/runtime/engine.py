"""The heterogeneous hybrid 3D-parallel training engine (FlashFlex/HexiScale in JAX).

``HeteroTrainer.step(batch)`` runs one optimizer step on the global batch (the pipelines' batches
concatenated in pipeline order):

1. Every pipeline runs its schedule (GPipe / 1F1B) on its own rows, in micro-batches.  All actions of
   all pipelines are dispatched in one dependency-respecting global order (``schedules.global_order``);
   JAX's asynchronous dispatch lets stages on different devices run at the same time.
2. Each micro-batch's loss term is ``sum(ce * w) / W`` with ``W`` the weight of the *whole* global
   batch, so per-stage gradients accumulated over micro-batches and summed over pipelines are the
   token-weighted gradient of the single-device loss (the seed averaged pipelines equally).
3. Gradient sync: for every stage of every pipeline, each of its submodules' gradients is gathered from
   every pipeline (resharded from that pipeline's layout onto this stage's) and summed in pipeline
   order -- the same elementwise sums everywhere, so all pipelines keep bit-identical parameters.
4. AdamW (optax) per stage.  AdamW is elementwise, so per-stage optimizers equal one global optimizer.

Per-action start/end times are measured by one watcher thread per stage that waits on each dispatched
computation; an action starts at the latest of its dispatch, its stage's previous action's end and its
producer's end.
"""
from __future__ import annotations

import functools
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cfp.errors import ConfigError
from cfp.models import init_params, min_batch_size, stage_modules
from cfp.runtime import comm
from cfp.runtime.layout import HeteroLayout, Stage
from cfp.runtime.schedules import SCHEDULES, Phase, ScheduleName, check_schedule, global_order
from cfp.runtime.stage import StageProgram, sum_trees
from cfp.runtime.timeline import Event


@dataclass
class StepStats:
    step: int
    loss: float
    seconds: float
    tokens: int
    events: list[Event] = field(default_factory=list)

    def busy(self) -> dict[tuple[int, int], float]:
        """Seconds each stage spent computing (fwd + bwd) in this step."""
        out: dict[tuple[int, int], float] = {}
        for e in self.events:
            out[(e.pipeline, e.stage)] = out.get((e.pipeline, e.stage), 0.0) + e.end - e.start
        return out


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


def optimizer(learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
    """The optimizer of ``cfp.models.train_step`` (AdamW), so the single-device replay matches."""
    return optax.adamw(learning_rate, weight_decay=weight_decay)


def _subtree(params: dict, names) -> dict:
    return {"params": {n: params["params"][n] for n in names}}


def _path_table(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


_PROGRAMS: dict[tuple, StageProgram] = {}


class HeteroTrainer:
    """Holds each local stage's params and optimizer state and runs training steps."""

    def __init__(self, model_name: str, config: Any, layout: HeteroLayout,
                 schedule: "str | ScheduleName" = ScheduleName.GPIPE, *, learning_rate: float = 1e-3,
                 weight_decay: float = 0.01, devices: Optional[list] = None,
                 stage_shardings: Optional[dict] = None):
        self.model_name, self.config, self.layout = model_name, config, layout
        self.devices = list(devices) if devices is not None else jax.devices()
        layout.validate_for(config, len(self.devices))
        mb_min = min_batch_size(config)
        for p in layout.pipelines:
            if p.micro_batch_size % mb_min:
                raise ConfigError(f"pipeline {p.index}: micro-batch size {p.micro_batch_size} must be "
                                  f"a multiple of {mb_min} so MoE token groups stay whole")
        self.tx = optimizer(learning_rate, weight_decay)
        self.modules = stage_modules(model_name, config)
        self.full_like = jax.eval_shape(lambda: init_params(model_name, config, 0))
        self.programs: dict[tuple[int, int], StageProgram] = {}
        for st in layout.stages:
            devs = [self.devices[d] for d in st.devices]
            if len({d.process_index for d in devs}) > 1:
                raise ConfigError(
                    f"stage {st.key} uses devices {list(st.devices)} of processes "
                    f"{sorted({d.process_index for d in devs})}; a stage's devices must belong to "
                    f"one process (choose devices_id accordingly)")
            # Compiled programs are reused by later trainers of the same model, stage and
            # optimizer (a resumed run, another schedule, a test): compiling dominates start-up.
            # ``stage_shardings``: stage key -> StageShardings of a searched stage plan (else Megatron)
            planned = (stage_shardings or {}).get(st.key)
            ckey = (model_name, config, st, tuple(devs), float(learning_rate), float(weight_decay),
                    planned)
            if ckey not in _PROGRAMS:
                _PROGRAMS[ckey] = StageProgram(st, self.modules, devs,
                                               _subtree(self.full_like, st.module_names()), self.tx,
                                               planned)
            self.programs[st.key] = _PROGRAMS[ckey]
        self.set_schedule(schedule)
        self.aux_coef = float(getattr(config, "aux_loss_coef", 0.0))
        self.params: dict[tuple[int, int], Any] = {}
        self.opt_state: dict[tuple[int, int], Any] = {}
        self.step_count = 0
        self._initialized = False
        self._watchers = {k: _watcher(pr.stage.devices) for k, pr in self.programs.items()
                          if pr.is_local}
        self._act_like: dict[tuple[int, int], Any] = {}

    # ------------------------------------------------------------------ state
    def init(self, seed: int = 0) -> "HeteroTrainer":
        """Initialise exactly like ``cfp.models.train_step(...).init(seed)``."""
        params = init_params(self.model_name, self.config, seed)
        return self.load_state(params, self.tx.init(params), 0)

    def load_state(self, params: Any, opt_state: Any, step: int) -> "HeteroTrainer":
        """Place a layout-independent state (full ``{"params": ...}`` tree + its optax state)."""
        opt_table = _path_table(opt_state)
        for key, prog in self.programs.items():
            if not prog.is_local:
                continue
            sub = prog.place_params(_subtree(params, prog.stage.module_names()))
            # the stage's optax state has the full state's leaves at the same key paths
            flat, treedef = jax.tree_util.tree_flatten_with_path(prog.opt_shardings)
            leaves = [jax.device_put(opt_table[jax.tree_util.keystr(p)], sh) for p, sh in flat]
            self.params[key] = sub
            self.opt_state[key] = jax.tree_util.tree_unflatten(treedef, leaves)
        self.step_count = int(step)
        self._initialized = True
        return self

    def state(self) -> tuple[Any, Any, int]:
        """The layout-independent state as host numpy trees: (params, opt_state, step).

        Every module is taken from the lowest-numbered pipeline holding it on this process (all
        pipelines hold identical values).  In a multi-process run modules held only elsewhere are
        fetched with a cross-process all-gather.
        """
        param_table: dict[str, Any] = {}
        opt_tables: list[dict[str, Any]] = []
        for key in sorted(self.params):
            param_table.update({k: v for k, v in _path_table(self.params[key]).items()
                                if k not in param_table})
            opt_tables.append(_path_table(self.opt_state[key]))
        opt_like = jax.eval_shape(self.tx.init, self.full_like)
        params_out = self._collect(self.full_like, param_table)
        opt_table = {}
        for t in opt_tables:
            opt_table.update({k: v for k, v in t.items() if k not in opt_table})
        return params_out, self._collect(opt_like, opt_table), self.step_count

    def _collect(self, like: Any, table: dict[str, Any]) -> Any:
        """Host numpy tree shaped like ``like`` from ``{keystr(path): array}``; in a multi-process
        run, leaves missing here come from the lowest-numbered process that has them."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        keys = [jax.tree_util.keystr(p) for p, _ in flat]
        leaves = [np.asarray(jax.device_get(table[k])) if k in table else np.zeros(l.shape, l.dtype)
                  for k, (_, l) in zip(keys, flat)]
        if jax.process_count() > 1:
            have = np.array([k in table for k in keys], np.int32)
            flags, gathered = _process_allgather((have, leaves))
            owner = np.argmax(np.asarray(flags), axis=0)  # first process holding each leaf
            leaves = [np.asarray(g)[owner[i]] for i, g in enumerate(gathered)]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def compile(self, workers: Optional[int] = None) -> float:
        """Compile every local stage program ahead of time, several at once (XLA compiles outside
        the GIL); the first step then only traces.  Returns the seconds it took."""
        t0 = time.perf_counter()
        jobs = []
        scalar = jax.ShapeDtypeStruct((), jnp.float32)
        for key, prog in self.programs.items():
            if not prog.is_local:
                continue
            pipe = self.layout.pipelines[key[0]]
            st = prog.stage
            params = _with_sharding(prog.params_like, prog.shardings)
            opt = _with_sharding(jax.eval_shape(self.tx.init, prog.params_like), prog.opt_shardings)
            tok = jax.ShapeDtypeStruct((pipe.micro_batch_size, self.config.seq_len), jnp.int32,
                                       sharding=prog.repl)
            x = tok.update(sharding=prog.act_in) if st.is_first else _with_sharding(
                self._act_shape(pipe.stages[st.index - 1].key), prog.act_in)
            if st.is_last:
                w = jax.ShapeDtypeStruct(tok.shape, jnp.float32, sharding=prog.repl)
                jobs += [(prog.fwd, (params, x, tok, w, scalar)),
                         (prog.bwd, (params, x, tok, w, scalar, scalar, params))]
            else:
                y = _with_sharding(self._act_shape(key), prog.act_out)
                jobs += [(prog.fwd, (params, x)), (prog.bwd, (params, x, y, scalar, params))]
            jobs += [(prog.zeros, ()), (prog.update, (params, opt, [params] * len(self.layout.pipelines)))]
        with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            list(pool.map(lambda j: j[0].lower(*j[1]).compile(), jobs))
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ helpers
    def _act_shape(self, key: tuple[int, int]) -> Any:
        """ShapeDtypeStruct of the activation stage ``key`` sends to the next stage."""
        if key not in self._act_like:
            pipe = self.layout.pipelines[key[0]]
            x = jax.ShapeDtypeStruct((pipe.micro_batch_size, self.config.seq_len), jnp.int32)
            for s in pipe.stages[:key[1] + 1]:
                x = jax.eval_shape(self.programs[s.key]._forward, self.programs[s.key].params_like, x)[0]
            self._act_like[key] = x
        return self._act_like[key]

    def _move(self, tree, src: Stage, dst: Stage, dst_shardings, like):
        return comm.move(tree, list(self.programs[src.key].mesh.devices.flat),
                         list(self.programs[dst.key].mesh.devices.flat), dst_shardings, like)

    # ------------------------------------------------------------------ one step
    def set_schedule(self, schedule: "str | ScheduleName") -> None:
        """Switch GPipe/1F1B; compiled stage programs do not depend on the schedule."""
        self.schedule = ScheduleName.parse(schedule)
        per_pipe = []
        for p in self.layout.pipelines:
            acts = SCHEDULES[self.schedule](p.num_stages, p.chunks)
            check_schedule(acts, p.chunks)
            per_pipe.append(acts)
        self.order = global_order(per_pipe)

    def step(self, batch: dict) -> StepStats:
        """One optimizer step on the global batch ``{"inputs", "targets", "weights"}`` [B_total, S]."""
        t_start = time.perf_counter()
        acc, loss, dispatched = self._run_schedule(batch)
        parts = self._gather_grads(acc)
        for key, g in parts.items():
            self.params[key], self.opt_state[key] = self.programs[key].update(
                self.params[key], self.opt_state[key], g)
        jax.block_until_ready(list(self.params.values()))
        seconds = time.perf_counter() - t_start
        self.step_count += 1
        rows = self.layout.total_batch_size
        return StepStats(self.step_count, loss, seconds, rows * self.config.seq_len,
                         self._events(dispatched, t_start))

    def gradients(self, batch: dict) -> tuple[Any, float]:
        """(full gradient tree as numpy, loss) of the global batch at the current parameters."""
        acc, loss, dispatched = self._run_schedule(batch)
        self._events(dispatched, 0.0)
        # summed on the host: the same elementwise float32 adds in the same order, no compile
        summed = {}
        for k, parts in self._gather_grads(acc).items():
            host = [jax.tree_util.tree_map(np.asarray, t) for t in parts]
            summed[k] = functools.reduce(lambda a, b: jax.tree_util.tree_map(np.add, a, b), host)
        table: dict[str, Any] = {}
        for key in sorted(summed):
            table.update({k: v for k, v in _path_table(summed[key]).items() if k not in table})
        return self._collect(self.full_like, table), loss

    def _run_schedule(self, batch: dict):
        """Dispatch every pipeline's fwd/bwd actions; returns (grad accumulators, loss, times)."""
        if not self._initialized:
            raise ConfigError("HeteroTrainer.step called before init() or load_state()")
        b = {k: np.asarray(v) for k, v in batch.items()}
        rows = b["inputs"].shape[0]
        if rows != self.layout.total_batch_size:
            raise ConfigError(f"batch has {rows} rows but the layout's global batch sizes sum to "
                              f"{self.layout.total_batch_size}")
        total_w = np.float32(b["weights"].astype(np.float32).sum())
        offsets = self.layout.batch_offsets()
        acts, grads_back, saved, labels, acc = {}, {}, {}, {}, {}
        ce_parts, aux_parts, dispatched = {}, {}, {}
        for idx, a in enumerate(self.order):
            key = (a.pipeline, a.stage)
            prog, pipe = self.programs[key], self.layout.pipelines[a.pipeline]
            st, m, mbs = prog.stage, a.microbatch, pipe.micro_batch_size
            lo = offsets[a.pipeline] + m * mbs
            # token-weighted share of this micro-batch in the MoE aux loss (0 for dense models)
            aux_ct = np.float32(self.aux_coef * mbs / self.layout.total_batch_size)
            t0 = time.perf_counter()
            if a.phase is Phase.FWD:
                if st.is_first:
                    x = jax.device_put(b["inputs"][lo:lo + mbs], prog.act_in) if prog.is_local else None
                else:
                    prev = pipe.stages[st.index - 1]
                    x = self._move(acts.pop((a.pipeline, st.index - 1, m), None), prev, st,
                                   prog.act_in, self._act_shape(prev.key))
                if not prog.is_local:
                    continue
                saved[(key, m)] = x
                if st.is_last:
                    lab = jax.device_put((b["targets"][lo:lo + mbs], b["weights"][lo:lo + mbs]),
                                         prog.repl)
                    labels[(key, m)] = lab
                    ce, aux = prog.fwd(self.params[key], x, lab[0], lab[1], total_w)
                    ce_parts[idx] = ce
                    done = ce
                else:
                    y, aux = prog.fwd(self.params[key], x)
                    acts[(a.pipeline, st.index, m)] = y
                    done = y
                aux_parts[idx] = (aux, aux_ct)
            else:
                g = None
                if not st.is_last:
                    nxt = pipe.stages[st.index + 1]
                    g = self._move(grads_back.pop((a.pipeline, st.index + 1, m), None), nxt, st,
                                   prog.act_out, self._act_shape(key))
                if not prog.is_local:
                    continue
                x = saved.pop((key, m))
                if key not in acc:
                    acc[key] = prog.zeros()
                if st.is_last:
                    tgt, w = labels.pop((key, m))
                    out = prog.bwd(self.params[key], x, tgt, w, total_w, aux_ct, acc[key])
                else:
                    out = prog.bwd(self.params[key], x, g, aux_ct, acc[key])
                acc[key] = out[0]
                if not st.is_first:
                    grads_back[(a.pipeline, st.index, m)] = out[1]
                done = out[-1]
            dispatched[(key, m, a.phase)] = t0
            self._watchers[key].q.put(((m, a.phase), done))

        # Loss terms by position in the global order, summed in that order in float64, so every
        # process (and a single-process run) adds the same numbers in the same order.
        n = len(self.order)
        ce_v, aux_v, aux_w = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n)
        for i, c in ce_parts.items():
            ce_v[i] = np.asarray(c)
        for i, (a, w) in aux_parts.items():
            aux_v[i], aux_w[i] = np.asarray(a), w
        if jax.process_count() > 1:
            ce_v, aux_v, aux_w = (np.asarray(t).sum(axis=0) for t in
                                  _process_allgather((ce_v, aux_v, aux_w.astype(np.float32))))
        loss = 0.0
        for i in range(n):
            loss += float(ce_v[i]) + float(aux_v[i]) * float(np.float32(aux_w[i]))
        return acc, loss, dispatched

    def _gather_grads(self, acc: dict) -> dict:
        """For every local stage, its submodules' gradients from every pipeline (in pipeline order),
        resharded onto this stage's layout; their sum is the token-weighted global gradient."""
        out = {}
        for dst in self.layout.stages:
            dprog = self.programs[dst.key]
            names = dst.module_names()
            parts = []
            for pipe in self.layout.pipelines:
                piece: dict[str, Any] = {}
                for src in pipe.stages:
                    common = [n for n in names if n in src.module_names()]
                    if not common:
                        continue
                    sprog = self.programs[src.key]
                    sub = _subtree(acc[src.key], common) if sprog.is_local else None
                    moved = self._move(sub, src, dst, _subtree(dprog.shardings, common),
                                       _subtree(dprog.params_like, common))
                    if moved is not None:
                        piece.update(moved["params"])
                if dprog.is_local:
                    parts.append({"params": {n: piece[n] for n in names}})
            if dprog.is_local:
                out[dst.key] = parts
        return out

    def _events(self, dispatched: dict, t_start: float) -> list[Event]:
        for w in self._watchers.values():
            w.q.join()
        ends = {(key, m, ph): w.ends[(m, ph)] for key, w in self._watchers.items()
                for (m, ph) in list(w.ends)}
        for w in self._watchers.values():
            w.ends.clear()
        events, last_end = [], {}
        for a in self.order:
            key = (a.pipeline, a.stage)
            k = (key, a.microbatch, a.phase)
            if k not in ends:
                continue
            deps = [last_end.get(key, t_start), dispatched[k]]
            if a.phase is Phase.FWD:
                deps.append(ends.get(((a.pipeline, a.stage - 1), a.microbatch, Phase.FWD), t_start))
            else:
                deps.append(ends.get(((a.pipeline, a.stage + 1), a.microbatch, Phase.BWD), t_start))
                deps.append(ends.get((key, a.microbatch, Phase.FWD), t_start))
            start = min(max(deps), ends[k])
            last_end[key] = ends[k]
            events.append(Event(a.pipeline, a.stage, a.microbatch, a.phase, start - t_start,
                                ends[k] - t_start))
        return events


def _with_sharding(like: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(lambda l, s: jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=s),
                                  like, shardings)


def _process_allgather(x: Any) -> Any:
    """Every process's copy of the (host) pytree ``x``, stacked on a new leading axis."""
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(x)
