"""One pass of every pipeline's schedule over a global batch.

All actions of all pipelines are dispatched in one dependency-respecting global order
(``schedules.global_order``); JAX's asynchronous dispatch lets stages on different devices run at
the same time.  Each micro-batch's loss term is ``sum(ce * w) / W`` with ``W`` the weight of the
*whole* global batch, so the per-stage gradients accumulated over micro-batches (in micro-batch
order) are the pipeline's share of the token-weighted gradient of the single-device loss.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from cfp.errors import ConfigError
from cfp.runtime import comm
from cfp.layout import Layout, PlacedStage
from cfp.runtime.schedules import Phase
from cfp.runtime.state import process_allgather, subtree
from cfp.runtime.stage.program import StageProgram
from cfp.runtime.timing import StepClock


def move(programs: dict, tree: Optional[Any], src: PlacedStage, dst: PlacedStage, dst_shardings: Any,
         like: Any) -> Optional[Any]:
    """``comm.move`` between two stages' device groups."""
    return comm.move(tree, list(programs[src.key].mesh.devices.flat),
                     list(programs[dst.key].mesh.devices.flat), dst_shardings, like)


PACKED_KEYS = ("segment_ids", "positions")


def split_batch(layout: Layout, batch: dict) -> list[list[dict]]:
    """A fixed-length global batch (the pipelines' rows concatenated in pipeline order) as each
    pipeline's ``chunks`` micro-batches of ``micro_batch_size`` rows."""
    b = {k: np.asarray(v) for k, v in batch.items()}
    rows = b["inputs"].shape[0]
    if rows != layout.global_batch:
        raise ConfigError(f"batch has {rows} rows but the layout's global batch sizes sum to "
                          f"{layout.global_batch}")
    out = []
    for pipe, off in zip(layout.pipelines, layout.batch_offsets()):
        mbs = pipe.micro_batch
        out.append([{k: v[off + m * mbs: off + (m + 1) * mbs] for k, v in b.items()}
                    for m in range(pipe.chunks)])
    return out


def check_micro_batches(layout: Layout, per_pipeline: Any) -> list[list[dict]]:
    """Per pipeline, its micro-batches as numpy dicts (``inputs``, ``targets``, ``weights`` [R,S], and for
    packed rows ``segment_ids`` and ``positions``); ConfigError naming what is wrong."""
    if not isinstance(per_pipeline, (list, tuple)) or len(per_pipeline) != len(layout.pipelines):
        n = len(per_pipeline) if isinstance(per_pipeline, (list, tuple)) else type(per_pipeline).__name__
        raise ConfigError(f"{n} micro-batch lists for {len(layout.pipelines)} pipelines")
    out = []
    for p, mbs in enumerate(per_pipeline):
        rows = []
        for m, mb in enumerate(mbs):
            mb = {k: np.asarray(v) for k, v in mb.items()}
            missing = [k for k in ("inputs", "targets", "weights") if k not in mb]
            packed = [k for k in PACKED_KEYS if k in mb]
            if missing or len(packed) == 1:
                raise ConfigError(f"pipeline {p} micro-batch {m} lacks {missing or PACKED_KEYS}")
            shapes = {k: v.shape for k, v in mb.items()}
            if len(set(shapes.values())) != 1 or len(mb["inputs"].shape) != 2:
                raise ConfigError(f"pipeline {p} micro-batch {m}: arrays must share one [rows, seq] "
                                  f"shape, got {shapes}")
            rows.append(mb)
        out.append(rows)
    if not any(out):
        raise ConfigError("a step needs at least one micro-batch")
    return out


class ActivationShapes:
    """ShapeDtypeStruct of the activation each stage sends to the next one, per micro-batch shape
    (cached)."""

    def __init__(self, layout: Layout, programs: dict[tuple[int, int], StageProgram],
                 seq_len: int):
        self.layout, self.programs, self.seq_len = layout, programs, seq_len
        self._cache: dict[tuple, Any] = {}

    def __call__(self, key: tuple[int, int], shape: Optional[tuple[int, int]] = None,
                 packed: bool = False) -> Any:
        pipe = self.layout.pipelines[key[0]]
        shape = tuple(shape) if shape is not None else (pipe.micro_batch, self.seq_len)
        ck = (key, shape, packed)
        if ck not in self._cache:
            x = jax.ShapeDtypeStruct(shape, jnp.int32)
            pk = (x, x) if packed else None
            for s in range(key[1] + 1):
                prog = self.programs[(key[0], s)]
                x = jax.eval_shape(prog.forward, prog.params_like, x, pk)[0]
            self._cache[ck] = x
        return self._cache[ck]


class ScheduleRun:
    """Dispatches one step's forward/backward actions; ``run(per_pipeline)`` -> (accumulators, loss).

    ``per_pipeline[p]`` are pipeline p's micro-batches (``check_micro_batches``); each may have its own
    shape (packed variable-length rows), and a pipeline may have none this step."""

    def __init__(self, layout: Layout, programs: dict, params: dict, order: list,
                 aux_coef: float, act_shape: ActivationShapes, clock: StepClock):
        self.layout, self.programs, self.params, self.order = layout, programs, params, order
        self.aux_coef, self.act_shape, self.clock = aux_coef, act_shape, clock
        # buffers between actions, keyed by (pipeline, stage, microbatch) or (stage key, microbatch)
        self.acts, self.grads_back, self.saved, self.labels = {}, {}, {}, {}
        self.acc: dict[tuple[int, int], Any] = {}
        self.ce_parts: dict[int, Any] = {}
        self.aux_parts: dict[int, tuple[Any, np.float32]] = {}

    def run(self, per_pipeline: list[list[dict]]) -> tuple[dict, float]:
        self.mbs = per_pipeline
        flat = [mb for mbs in per_pipeline for mb in mbs]
        # one pairwise sum over the weights in global-batch order (as the single-device loss sums them)
        self.total_w = np.float32(np.concatenate([mb["weights"].astype(np.float32).ravel()
                                                  for mb in flat]).sum())
        self.total_rows = sum(mb["inputs"].shape[0] for mb in flat)
        for idx, a in enumerate(self.order):
            t0 = time.perf_counter()
            done = self._forward(idx, a) if a.phase is Phase.FWD else self._backward(a)
            if done is not None:  # None: another process's stage
                self.clock.dispatched((a.pipeline, a.stage), a.microbatch, a.phase, t0, done)
        for key, prog in self.programs.items():  # a pipeline without micro-batches adds zeros
            if prog.is_local and key not in self.acc:
                self.acc[key] = prog.zeros()
        return self.acc, self._loss()

    def _aux_ct(self, a) -> np.float32:
        """This micro-batch's share of the MoE aux loss (0 for dense models): its share of the step's
        tokens for packed rows, of its rows for fixed-length ones."""
        mb = self.mbs[a.pipeline][a.microbatch]
        if "segment_ids" in mb:
            return np.float32(self.aux_coef * float(mb["weights"].sum()) / max(float(self.total_w), 1e-9))
        return np.float32(self.aux_coef * mb["inputs"].shape[0] / self.total_rows)

    def _packed(self, a, prog) -> dict:
        """``packed=`` keyword of the stage programs (empty for fixed-length rows)."""
        mb = self.mbs[a.pipeline][a.microbatch]
        if "segment_ids" not in mb:
            return {}
        return {"packed": jax.device_put((mb["segment_ids"], mb["positions"]), prog.rows)}

    def _like(self, a, key) -> Any:
        mb = self.mbs[a.pipeline][a.microbatch]
        return self.act_shape(key, mb["inputs"].shape, "segment_ids" in mb)

    def _forward(self, idx: int, a) -> Optional[Any]:
        key, m = (a.pipeline, a.stage), a.microbatch
        prog = self.programs[key]
        st = prog.stage
        mb = self.mbs[a.pipeline][m]
        if st.is_first:
            x = jax.device_put(mb["inputs"], prog.act_in) if prog.is_local else None
        else:
            prev = self.layout.place((a.pipeline, st.index - 1))
            x = move(self.programs, self.acts.pop((a.pipeline, st.index - 1, m), None), prev, st,
                     prog.act_in, self._like(a, prev.key))
        if not prog.is_local:
            return None
        self.saved[(key, m)] = x
        kw = self._packed(a, prog)
        if st.is_last:
            lab = jax.device_put((mb["targets"], mb["weights"]), prog.rows)
            self.labels[(key, m)] = (lab, kw)
            out, aux = prog.fwd(self.params[key], x, lab[0], lab[1], self.total_w, **kw)
            self.ce_parts[idx] = out
        else:
            out, aux = prog.fwd(self.params[key], x, **kw)
            self.acts[(a.pipeline, st.index, m)] = out
        self.aux_parts[idx] = (aux, self._aux_ct(a))
        return out

    def _backward(self, a) -> Optional[Any]:
        key, m = (a.pipeline, a.stage), a.microbatch
        prog = self.programs[key]
        st = prog.stage
        g = None
        if not st.is_last:
            nxt = self.layout.place((a.pipeline, st.index + 1))
            g = move(self.programs, self.grads_back.pop((a.pipeline, st.index + 1, m), None), nxt,
                     st, prog.act_out, self._like(a, key))
        if not prog.is_local:
            return None
        x = self.saved.pop((key, m))
        if key not in self.acc:
            self.acc[key] = prog.zeros()
        if st.is_last:
            (tgt, w), kw = self.labels.pop((key, m))
            out = prog.bwd(self.params[key], x, tgt, w, self.total_w, self._aux_ct(a), self.acc[key],
                           **kw)
        else:
            out = prog.bwd(self.params[key], x, g, self._aux_ct(a), self.acc[key],
                           **self._packed(a, prog))
        self.acc[key] = out[0]
        if not st.is_first:
            self.grads_back[(a.pipeline, st.index, m)] = out[1]
        return out[-1]

    def _loss(self) -> float:
        """Loss terms by position in the global order, summed in that order in float64, so every
        process (and a single-process run) adds the same numbers in the same order."""
        n = len(self.order)
        ce_v, aux_v, aux_w = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
        for i, c in self.ce_parts.items():
            ce_v[i] = np.asarray(c)
        for i, (a, w) in self.aux_parts.items():
            aux_v[i], aux_w[i] = np.asarray(a), w
        if jax.process_count() > 1:
            ce_v, aux_v, aux_w = (np.asarray(t).sum(axis=0) for t in
                                  process_allgather((ce_v, aux_v, aux_w)))
        loss = 0.0
        for i in range(n):
            loss += float(ce_v[i]) + float(aux_v[i]) * float(aux_w[i])
        return loss


def sync_gradients(layout: Layout, programs: dict, acc: dict) -> dict:
    """For every local stage, its submodules' gradients from every pipeline (in pipeline order),
    resharded onto this stage's gradient shardings; their sum is the token-weighted global gradient.

    The same elementwise sums in the same order happen everywhere a module is held, so all
    pipelines keep bit-identical parameters."""
    out = {}
    for dst in layout.placed:
        dprog = programs[dst.key]
        names = dst.module_names()
        parts = []
        for p in range(len(layout.pipelines)):
            piece: dict[str, Any] = {}
            for src in layout.placed_in(p):
                common = [n for n in names if n in src.module_names()]
                if not common:
                    continue
                sub = subtree(acc[src.key], common) if programs[src.key].is_local else None
                moved = move(programs, sub, src, dst, subtree(dprog.grad_shardings, common),
                             subtree(dprog.params_like, common))
                if moved is not None:
                    piece.update(moved["params"])
            if dprog.is_local:
                parts.append({"params": {n: piece[n] for n in names}})
        if dprog.is_local:
            out[dst.key] = parts
    return out
