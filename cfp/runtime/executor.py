"""One pass of every pipeline's schedule over a global batch, and the gradient sync across pipelines.

All actions of all pipelines are dispatched in one dependency-respecting global order
(``cfp.schedules.registry.global_order``); JAX's asynchronous dispatch lets stages on different devices run at the same
time. The last stage of each pipeline returns every micro-batch's ``(loss_sum, weight)``; each stage
accumulates the gradient of the summed ``loss_sum`` over its micro-batches, and the update scales the sum by
``1 / total weight`` (`StageProgram.update`), so the step's gradient is that of the single-device loss
``sum(loss_sum) / sum(weight)``.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from cfp.errors import ConfigError, NumericalError
from cfp.layout import Layout, PlacedStage
from cfp.runtime import comm
from cfp.runtime.host_state import process_allgather
from cfp.runtime.stage import activations
from cfp.runtime.timing import StepClock
from cfp.schedules.registry import Phase


def move(programs: dict, tree: Optional[Any], src: PlacedStage, dst: PlacedStage, dst_shardings: Any,
         like: Any) -> Optional[Any]:
    """``comm.move`` between two stages' device groups."""
    return comm.move(tree, list(programs[src.key].mesh.devices.flat),
                     list(programs[dst.key].mesh.devices.flat), dst_shardings, like)


def rows_of(batch: Any) -> int:
    """The leading (batch) dim its leaves share; ConfigError when they do not."""
    leaves = jax.tree_util.tree_leaves(batch)
    dims = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    if len(dims) != 1 or None in dims:
        raise ConfigError(f"a batch's leaves must share a leading batch dim, got leading dims {sorted(map(str, dims))}")
    return dims.pop()


def split_batch(layout: Layout, batch: Any) -> list[list[Any]]:
    """A global batch (any pytree; the pipelines' rows concatenated in pipeline order) as each pipeline's
    ``chunks`` micro-batches of ``micro_batch`` rows."""
    b = jax.tree_util.tree_map(np.asarray, batch)
    rows = rows_of(b)
    if rows != layout.global_batch:
        raise ConfigError(f"batch has {rows} rows but the layout's global batch sizes sum to "
                          f"{layout.global_batch}")
    out = []
    for pipe, off in zip(layout.pipelines, layout.batch_offsets()):
        mbs = pipe.micro_batch
        out.append([jax.tree_util.tree_map(lambda v: v[off + m * mbs: off + (m + 1) * mbs], b)
                    for m in range(pipe.chunks)])
    return out


def check_micro_batches(layout: Layout, per_pipeline: Any) -> list[list[Any]]:
    """Per pipeline, its micro-batches (pytrees of numpy arrays sharing a leading dim; any count, any shapes);
    ConfigError naming what is wrong."""
    if not isinstance(per_pipeline, (list, tuple)) or len(per_pipeline) != len(layout.pipelines):
        n = len(per_pipeline) if isinstance(per_pipeline, (list, tuple)) else type(per_pipeline).__name__
        raise ConfigError(f"{n} micro-batch lists for {len(layout.pipelines)} pipelines")
    out = []
    for p, mbs in enumerate(per_pipeline):
        rows = []
        for m, mb in enumerate(mbs):
            mb = jax.tree_util.tree_map(np.asarray, mb)
            try:
                rows_of(mb)
            except ConfigError as e:
                raise ConfigError(f"pipeline {p} micro-batch {m}: {e}") from None
            rows.append(mb)
        out.append(rows)
    if not any(out):
        raise ConfigError("a step needs at least one micro-batch")
    return out


def _like(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


class ActivationShapes:
    """ShapeDtypeStructs of the activation each stage sends on, per micro-batch shape (cached)."""

    def __init__(self, layout: Layout, programs: dict):
        self.layout, self.programs = layout, programs
        self._cache: dict[tuple, Any] = {}

    def __call__(self, key: tuple[int, int], batch_like: Any) -> Any:
        """Stage ``key``'s output activation for a micro-batch shaped like ``batch_like``."""
        sig = (key, jax.tree_util.tree_structure(batch_like),
               tuple((l.shape, str(l.dtype)) for l in jax.tree_util.tree_leaves(batch_like)))
        if sig not in self._cache:
            x = None
            for s in range(key[1] + 1):
                prog = self.programs[(key[0], s)]
                b = batch_like if prog.stage.is_first or prog.stage.is_last else None
                x = jax.eval_shape(prog.run, prog.params_like, x, b)
            self._cache[sig] = x
        return self._cache[sig]


def device_bytes(tree: Any, shardings: Any = None) -> int:
    """Bytes one device holds of ``tree``'s arrays, each leaf's shard shape under its sharding (0 for None);
    ``shardings``: the leaves' shardings, for a tree of shapes (ShapeDtypeStructs) placed with them."""
    leaves = jax.tree_util.tree_leaves(tree)
    placed = (jax.tree_util.tree_leaves(shardings) if shardings is not None
              else [getattr(leaf, "sharding", None) for leaf in leaves])
    total = 0
    for leaf, sharding in zip(leaves, placed):
        total += _shard_bytes(sharding, tuple(np.shape(leaf)), np.dtype(leaf.dtype).itemsize)
    return total


@functools.lru_cache(maxsize=4096)
def _shard_bytes(sharding: Any, shape: tuple, itemsize: int) -> int:
    """Bytes of one device's shard of an array of ``shape`` under ``sharding`` (None: the whole array); cached: the
    dispatcher counts a micro-batch's tens of residuals after every action."""
    shard = sharding.shard_shape(shape) if sharding is not None else shape
    return int(np.prod(shard, dtype=np.int64)) * itemsize


class KeptMemory:
    """Per stage, the most bytes per device of micro-batch activations a step held between its actions: what the
    dispatcher's buffers ``saved`` (each input from its F to its backward) and ``kept`` (B's input and output
    gradient until its W) hold of the stage, read after each of its actions. ``stage_of`` maps an expanded stage
    key to the stage whose devices run it (`cfp.runtime.vstages`): its virtual stages' buffers count together."""

    def __init__(self, saved: dict, kept: dict, stage_of: Callable = lambda key: key):
        self.saved, self.kept, self.stage_of = saved, kept, stage_of
        self.peak: dict[tuple[int, int], int] = {}
        # each buffer's bytes, counted once (a micro-batch's residuals are tens of arrays, observed after every
        # action): by id, the buffer held here so that its id is not reused within the step
        self._sizes: dict[int, tuple[Any, int]] = {}

    def _bytes(self, v: Any) -> int:
        hit = self._sizes.get(id(v))
        if hit is None:
            hit = self._sizes[id(v)] = (v, device_bytes(v))
        return hit[1]

    def observe(self, key: tuple[int, int]) -> None:
        at = self.stage_of(key)
        held = sum(self._bytes(v) for buf in (self.saved, self.kept) for (k, _), v in buf.items()
                   if self.stage_of(k) == at)
        self.peak[at] = max(self.peak.get(at, 0), held)


class ScheduleRun:
    """Dispatches one step's forward/backward actions; ``run(per_pipeline)`` -> (accumulators, loss, weight).

    ``per_pipeline[p]`` are pipeline p's micro-batches (``check_micro_batches``); each may have its own shape
    (packed variable-length rows), and a pipeline may have none this step. ``serial``: each action waits for the
    one before it to end (one action at a time: its measured time is its own, not shared with the other stages
    computing on the same cores)."""

    def __init__(self, layout: Layout, programs: dict, params: dict, order: list, act_shape: ActivationShapes,
                 clock: StepClock, stage_of: Callable = lambda key: key, serial: bool = False):
        self.layout, self.programs, self.params, self.order = layout, programs, params, order
        self.act_shape, self.clock, self.serial = act_shape, clock, serial
        # buffers between actions, keyed by (pipeline, stage, microbatch) or (stage key, microbatch)
        self.acts, self.grads_back, self.saved, self.batches = {}, {}, {}, {}
        self.kept: dict[tuple, tuple] = {}   # (stage key, microbatch) -> what W reads, from its B
        self.memory = KeptMemory(self.saved, self.kept, stage_of)
        self.acc: dict[tuple[int, int], Any] = {}
        self.loss_parts: dict[int, Any] = {}

    def run(self, per_pipeline: list[list[Any]]) -> tuple[dict, float, float]:
        self.mbs = per_pipeline
        for idx, a in enumerate(self.order):
            t0 = time.perf_counter()
            if a.phase is Phase.FWD:
                done = self._forward(idx, a)
            elif a.phase is Phase.BWD_WEIGHT:
                done = self._backward_weight(a)
            else:
                done = self._backward(a)
            if done is not None:  # None: another process's stage
                self.clock.dispatched((a.pipeline, a.stage), a.microbatch, a.phase, t0, done)
                self.memory.observe((a.pipeline, a.stage))
                if self.serial:
                    jax.block_until_ready(done)
                    self.clock.alone((a.pipeline, a.stage), a.microbatch, a.phase, time.perf_counter())
        for key, prog in self.programs.items():  # a pipeline without micro-batches adds zeros
            if prog.is_local and key not in self.acc:
                self.acc[key] = prog.zeros()
        return (self.acc,) + self._loss()

    def _batch(self, a, prog) -> Optional[Any]:
        """The micro-batch on the stage's devices (first and last stages), None elsewhere; placed once."""
        st = prog.stage
        if not (st.is_first or st.is_last):
            return None
        k = ((a.pipeline, a.stage), a.microbatch)
        if k not in self.batches:
            mb = self.mbs[a.pipeline][a.microbatch]
            self.batches[k] = jax.device_put(mb, prog.batch_shardings(_like(mb)))
        return self.batches[k]

    def _out_like(self, a, key) -> Any:
        return self.act_shape(key, _like(self.mbs[a.pipeline][a.microbatch]))

    def _forward(self, idx: int, a) -> Optional[Any]:
        key, m = (a.pipeline, a.stage), a.microbatch
        prog = self.programs[key]
        st = prog.stage
        x = None
        if not st.is_first:
            prev = self.layout.place((a.pipeline, st.index - 1))
            like = self._out_like(a, prev.key)
            x = move(self.programs, self.acts.pop((a.pipeline, st.index - 1, m), None), prev, st,
                     prog.act_in_shardings(like), like)
        if not prog.is_local:
            return None
        out, self.saved[(key, m)] = prog.forward(self.params[key], x, self._batch(a, prog))
        if st.is_last:
            self.loss_parts[idx] = out
        else:
            self.acts[(a.pipeline, st.index, m)] = out
        return out

    def _backward(self, a) -> Optional[Any]:
        """The whole backward (`Phase.BWD`) or its B (`Phase.BWD_INPUT`, keeping what W needs)."""
        key, m = (a.pipeline, a.stage), a.microbatch
        prog = self.programs[key]
        st = prog.stage
        g = None
        if not st.is_last:
            nxt = self.layout.place((a.pipeline, st.index + 1))
            like = self._out_like(a, key)
            g = move(self.programs, self.grads_back.pop((a.pipeline, st.index + 1, m), None), nxt, st,
                     prog.act_out_shardings(like), activations.gradient_like(like))
        if not prog.is_local:
            return None
        kept = self.saved.pop((key, m))
        batch = self._batch(a, prog)
        if a.phase is Phase.BWD_INPUT:
            g_x, self.kept[(key, m)], done = prog.backward_input(self.params[key], kept, batch, g)
        else:
            acc, g_x, done = prog.backward(self.params[key], kept, batch, g, self._acc(key, prog))
            self.acc[key] = acc
        if not st.is_first:
            self.grads_back[(a.pipeline, st.index, m)] = g_x
        return done

    def _backward_weight(self, a) -> Optional[Any]:
        """W: the micro-batch's parameter gradient into the stage's accumulator, from what its B kept."""
        key, m = (a.pipeline, a.stage), a.microbatch
        prog = self.programs[key]
        if not prog.is_local:
            return None
        acc, done = prog.backward_weight(self.params[key], self.kept.pop((key, m)), self._batch(a, prog),
                                         self._acc(key, prog))
        self.acc[key] = acc
        return done

    def _acc(self, key, prog) -> Any:
        if key not in self.acc:
            self.acc[key] = prog.zeros()
        return self.acc[key]

    def _loss(self) -> tuple[float, float]:
        """(loss, total weight): the micro-batches' ``loss_sum`` and ``weight`` by position in the global order,
        summed in that order in float64, so every process (and a single-process run) adds the same numbers in
        the same order."""
        n = len(self.order)
        parts = np.zeros((n, 2), np.float64)
        for i, (s, w) in self.loss_parts.items():
            parts[i] = float(s), float(w)
        if jax.process_count() > 1:
            parts = np.asarray(process_allgather(parts)).sum(axis=0)
        loss_sum, weight = float(np.sum(parts[:, 0])), float(np.sum(parts[:, 1]))
        if not (np.isfinite(weight) and weight > 0):
            raise NumericalError(f"the step's total weight is {weight}; the loss sum(loss_sum) / sum(weight) "
                                 "needs a positive, finite weight")
        return loss_sum / weight, weight


def _layer_pieces(dst: PlacedStage, src_stages) -> list[tuple[PlacedStage, int, int]]:
    """(source stage, first layer, stop) of the layers stage ``dst`` holds, by the source stages holding them,
    in layer order (global layer indices)."""
    out = []
    for src in src_stages:
        lo, hi = max(dst.layer_start, src.layer_start), min(dst.layer_end, src.layer_end)
        if lo < hi:
            out.append((src, lo, hi))
    return out


def grad_pieces(layout: Layout, dst: PlacedStage) -> list[list[int]]:
    """Per pipeline, the layer counts of the pieces stage ``dst``'s gradient arrives in."""
    return [[hi - lo for _, lo, hi in _layer_pieces(dst, layout.placed_in(p))] for p in range(len(layout.pipelines))]


def sync_gradients(layout: Layout, programs: dict, acc: dict, slicer: Any) -> dict:
    """For every local stage of pipeline 0 (which updates the parameters for all), its gradient from every pipeline
    (in pipeline order): ``first`` and ``last`` from that pipeline's first and last stages, its layers as the
    pieces of the stages holding them there, each moved onto this stage's gradient shardings. Their sum is the
    step's gradient (`StageProgram.summed`). ``slicer(key, layers, start, stop)``: a stage's accumulated layer
    gradients cut to its local layers ``start .. stop-1`` (on its devices)."""
    out = {}
    for dst in layout.placed_in(0):
        dprog = programs[dst.key]
        parts = [_gather_from(programs, layout.placed_in(p), dst, acc, slicer, dprog.layer_shardings,
                              dprog.grad_shardings) for p in range(len(layout.pipelines))]
        if dprog.is_local:
            out[dst.key] = parts
    return out


def broadcast_params(layout: Layout, programs: dict, params: dict, slicer: Any, joiner: Any) -> None:
    """Every stage of the other pipelines gets pipeline 0's new parameters (in place in ``params``): its layers from
    the pipeline-0 stages holding them (pieces joined by ``joiner(key, pieces)`` on its devices), ``first`` and
    ``last`` from pipeline 0's first and last stage. So all pipelines hold the same bits, whatever their stage
    boundaries and TP degrees."""
    src_stages = layout.placed_in(0)
    for p in range(1, len(layout.pipelines)):
        for dst in layout.placed_in(p):
            dprog = programs[dst.key]
            got = _gather_from(programs, src_stages, dst, params, slicer,
                               lambda a, b: dprog.layer_shardings(a, b, params=True), dprog.shardings)
            if dprog.is_local:
                rest = {k: v for k, v in got.items() if k != "layers"}
                params[dst.key] = dict(rest, layers=joiner(dst.key, got["layers"])) if got["layers"] else rest


def _gather_from(programs: dict, srcs, dst: PlacedStage, trees: dict, slicer: Any, layer_shardings: Any,
                 shardings: Any) -> dict:
    """Stage ``dst``'s part of the trees the stages ``srcs`` (one pipeline) hold: its layers as one piece per source
    stage holding some of them, ``first``/``last`` from the first/last source, all moved onto ``dst``'s shardings
    (None where this process holds neither end)."""
    dprog = programs[dst.key]
    part = {"layers": []}
    for src, lo, hi in _layer_pieces(dst, srcs):
        sprog = programs[src.key]
        a, b = lo - src.layer_start, hi - src.layer_start
        sub = slicer(src.key, trees[src.key]["layers"], a, b) if sprog.is_local else None
        part["layers"].append(move(programs, sub, src, dst, layer_shardings(lo - dst.layer_start,
                                                                            hi - dst.layer_start),
                                   sprog.layers_like(a, b)))
    for name, src in (("first", srcs[0]), ("last", srcs[-1])):
        if name in dprog.params_like:
            sub = trees[src.key][name] if programs[src.key].is_local else None
            part[name] = move(programs, sub, src, dst, shardings[name], dprog.params_like[name])
    return part
