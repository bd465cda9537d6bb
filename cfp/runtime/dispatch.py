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
from cfp.runtime.layout import HeteroLayout, Stage
from cfp.runtime.schedules import Phase
from cfp.runtime.state import process_allgather, subtree
from cfp.runtime.stage import StageProgram
from cfp.runtime.timing import StepClock


def move(programs: dict, tree: Optional[Any], src: Stage, dst: Stage, dst_shardings: Any,
         like: Any) -> Optional[Any]:
    """``comm.move`` between two stages' device groups."""
    return comm.move(tree, list(programs[src.key].mesh.devices.flat),
                     list(programs[dst.key].mesh.devices.flat), dst_shardings, like)


class ActivationShapes:
    """ShapeDtypeStruct of the activation each stage sends to the next one (cached)."""

    def __init__(self, layout: HeteroLayout, programs: dict[tuple[int, int], StageProgram],
                 seq_len: int):
        self.layout, self.programs, self.seq_len = layout, programs, seq_len
        self._cache: dict[tuple[int, int], Any] = {}

    def __call__(self, key: tuple[int, int]) -> Any:
        if key not in self._cache:
            pipe = self.layout.pipelines[key[0]]
            x = jax.ShapeDtypeStruct((pipe.micro_batch_size, self.seq_len), jnp.int32)
            for s in pipe.stages[:key[1] + 1]:
                prog = self.programs[s.key]
                x = jax.eval_shape(prog.forward, prog.params_like, x)[0]
            self._cache[key] = x
        return self._cache[key]


class ScheduleRun:
    """Dispatches one step's forward/backward actions; ``run(batch)`` -> (accumulators, loss)."""

    def __init__(self, layout: HeteroLayout, programs: dict, params: dict, order: list,
                 aux_coef: float, act_shape: ActivationShapes, clock: StepClock):
        self.layout, self.programs, self.params, self.order = layout, programs, params, order
        self.aux_coef, self.act_shape, self.clock = aux_coef, act_shape, clock
        self.offsets = layout.batch_offsets()
        # buffers between actions, keyed by (pipeline, stage, microbatch) or (stage key, microbatch)
        self.acts, self.grads_back, self.saved, self.labels = {}, {}, {}, {}
        self.acc: dict[tuple[int, int], Any] = {}
        self.ce_parts: dict[int, Any] = {}
        self.aux_parts: dict[int, tuple[Any, np.float32]] = {}

    def run(self, batch: dict) -> tuple[dict, float]:
        self.batch = self._check(batch)
        self.total_w = np.float32(self.batch["weights"].astype(np.float32).sum())
        for idx, a in enumerate(self.order):
            t0 = time.perf_counter()
            done = self._forward(idx, a) if a.phase is Phase.FWD else self._backward(a)
            if done is not None:  # None: another process's stage
                self.clock.dispatched((a.pipeline, a.stage), a.microbatch, a.phase, t0, done)
        return self.acc, self._loss()

    def _check(self, batch: dict) -> dict:
        b = {k: np.asarray(v) for k, v in batch.items()}
        rows = b["inputs"].shape[0]
        if rows != self.layout.total_batch_size:
            raise ConfigError(f"batch has {rows} rows but the layout's global batch sizes sum to "
                              f"{self.layout.total_batch_size}")
        return b

    def _rows(self, a) -> slice:
        mbs = self.layout.pipelines[a.pipeline].micro_batch_size
        lo = self.offsets[a.pipeline] + a.microbatch * mbs
        return slice(lo, lo + mbs)

    def _aux_ct(self, a) -> np.float32:
        """Token-weighted share of this micro-batch in the MoE aux loss (0 for dense models)."""
        mbs = self.layout.pipelines[a.pipeline].micro_batch_size
        return np.float32(self.aux_coef * mbs / self.layout.total_batch_size)

    def _forward(self, idx: int, a) -> Optional[Any]:
        key, m = (a.pipeline, a.stage), a.microbatch
        prog = self.programs[key]
        st, pipe = prog.stage, self.layout.pipelines[a.pipeline]
        if st.is_first:
            x = jax.device_put(self.batch["inputs"][self._rows(a)], prog.act_in) if prog.is_local else None
        else:
            prev = pipe.stages[st.index - 1]
            x = move(self.programs, self.acts.pop((a.pipeline, st.index - 1, m), None), prev, st,
                     prog.act_in, self.act_shape(prev.key))
        if not prog.is_local:
            return None
        self.saved[(key, m)] = x
        if st.is_last:
            rows = self._rows(a)
            lab = jax.device_put((self.batch["targets"][rows], self.batch["weights"][rows]), prog.repl)
            self.labels[(key, m)] = lab
            out, aux = prog.fwd(self.params[key], x, lab[0], lab[1], self.total_w)
            self.ce_parts[idx] = out
        else:
            out, aux = prog.fwd(self.params[key], x)
            self.acts[(a.pipeline, st.index, m)] = out
        self.aux_parts[idx] = (aux, self._aux_ct(a))
        return out

    def _backward(self, a) -> Optional[Any]:
        key, m = (a.pipeline, a.stage), a.microbatch
        prog = self.programs[key]
        st, pipe = prog.stage, self.layout.pipelines[a.pipeline]
        g = None
        if not st.is_last:
            nxt = pipe.stages[st.index + 1]
            g = move(self.programs, self.grads_back.pop((a.pipeline, st.index + 1, m), None), nxt,
                     st, prog.act_out, self.act_shape(key))
        if not prog.is_local:
            return None
        x = self.saved.pop((key, m))
        if key not in self.acc:
            self.acc[key] = prog.zeros()
        if st.is_last:
            tgt, w = self.labels.pop((key, m))
            out = prog.bwd(self.params[key], x, tgt, w, self.total_w, self._aux_ct(a), self.acc[key])
        else:
            out = prog.bwd(self.params[key], x, g, self._aux_ct(a), self.acc[key])
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


def sync_gradients(layout: HeteroLayout, programs: dict, acc: dict) -> dict:
    """For every local stage, its submodules' gradients from every pipeline (in pipeline order),
    resharded onto this stage's gradient shardings; their sum is the token-weighted global gradient.

    The same elementwise sums in the same order happen everywhere a module is held, so all
    pipelines keep bit-identical parameters."""
    out = {}
    for dst in layout.stages:
        dprog = programs[dst.key]
        names = dst.module_names()
        parts = []
        for pipe in layout.pipelines:
            piece: dict[str, Any] = {}
            for src in pipe.stages:
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
