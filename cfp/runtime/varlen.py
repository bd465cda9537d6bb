"""Executor for variable-length steps: data parallelism across pipelines of different <CP,TP> schemes.

Each pipeline owns a sub-mesh ("cp", "tp") of the devices and runs its packed micro-batches with gradient
accumulation (one compiled program per micro-batch shape; shapes are bucketed so compiles stay bounded).
The step's gradients are summed across pipelines in a fixed order on the home layout (pipeline 0's), the
loss is normalised by the step's real tokens (so packing does not change it), and the optimizer updates the
home state, which every pipeline copies at the start of the next step. CP attention (ring) is used inside
a pipeline with cp > 1; pipeline parallelism (pp > 1) is not executed here (cfp.runtime's engine runs pp).
Micro-batches (and so pipelines) run one after another: on simulated CPU devices the pipelines share the
host's cores anyway, and overlapping programs with collectives can hang XLA:CPU (see PipelineRunner.grads).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from cfp.errors import ConfigError
from cfp.models import build_model
from cfp.models.attention import ContextParallel, CpMethod, context_parallel
from cfp.runtime.switch import reshard, state_shardings

BATCH_KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class PipelineMesh:
    cp: int
    tp: int
    devices: tuple[int, ...]   # device ids, cp-major

    def __post_init__(self):
        if self.cp * self.tp != len(self.devices):
            raise ConfigError(f"pipeline cp={self.cp} x tp={self.tp} needs {self.cp * self.tp} devices, "
                              f"got {len(self.devices)}")

    def mesh(self) -> Mesh:
        by_id = {d.id: d for d in jax.devices()}
        missing = [i for i in self.devices if i not in by_id]
        if missing:
            raise ConfigError(f"device ids {missing} do not exist ({len(by_id)} devices)")
        devs = np.array([by_id[i] for i in self.devices]).reshape(self.cp, self.tp)
        return Mesh(devs, ("cp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))


def place_pipelines(shapes: Sequence[tuple[int, int]], num_devices: int) -> list[PipelineMesh]:
    """Consecutive device ids for pipelines of the given (cp, tp) shapes."""
    need = sum(c * t for c, t in shapes)
    if need > num_devices:
        raise ConfigError(f"the strategy needs {need} devices, only {num_devices} are available")
    out, start = [], 0
    for c, t in shapes:
        out.append(PipelineMesh(c, t, tuple(range(start, start + c * t))))
        start += c * t
    return out


class PipelineRunner:
    """Compiled per-micro-batch (token-weighted loss sum, gradients) on one pipeline's mesh."""

    def __init__(self, model_name: str, config, pm: PipelineMesh, params_like, cp_method=CpMethod.RING):
        self.pm = pm
        self.mesh = pm.mesh()
        model = build_model(model_name, config)
        coef = getattr(config, "aux_loss_coef", 0.0)
        kv_heads = getattr(config, "num_kv_heads", config.num_heads)
        heads_ok = config.num_heads % pm.tp == 0 and kv_heads % pm.tp == 0
        cp = ContextParallel(self.mesh, "cp", cp_method, "tp" if heads_ok and pm.tp > 1 else None)

        def loss_sum(params, mb):
            scope = context_parallel(cp) if pm.cp > 1 else contextlib.nullcontext()
            with scope:
                logits, aux = model.apply(params, mb["inputs"], segment_ids=mb["segment_ids"],
                                          positions=mb["positions"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), mb["targets"])
            w = mb["weights"]
            total = jnp.sum(ce * w)
            return total + coef * aux * jnp.sum(w) if coef else total

        self.pshard, _ = state_shardings(params_like, (), self.mesh)
        self.bshard = NamedSharding(self.mesh, P(None, "cp"))
        self._fn = jax.jit(jax.value_and_grad(loss_sum), in_shardings=(self.pshard, self.bshard),
                           out_shardings=(NamedSharding(self.mesh, P()), self.pshard))
        self._compiled: dict = {}
        self.compile_s = 0.0

    def compiled(self, params, shape: tuple[int, int]):
        if shape not in self._compiled:
            t0 = time.perf_counter()
            spec = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "weights" else jnp.int32)
                    for k in BATCH_KEYS}
            self._compiled[shape] = self._fn.lower(params, spec).compile()
            self.compile_s += time.perf_counter() - t0
        return self._compiled[shape]

    def grads(self, params, micro_batches: Sequence[dict]):
        """Σ over micro-batches of (weighted loss sum, gradients).

        Each micro-batch finishes before the next is dispatched: XLA:CPU collectives of two in-flight
        programs on the same devices can starve each other's rendezvous on a small thread pool (seen as a
        hang with 3 of 8 participants arrived), so programs with collectives never overlap here."""
        loss, acc = None, None
        for mb in micro_batches:
            mb = {k: jax.device_put(mb[k], self.bshard) for k in BATCH_KEYS}
            l, g = self.compiled(params, mb["inputs"].shape)(params, mb)
            loss = l if loss is None else loss + l
            acc = g if acc is None else jax.tree_util.tree_map(jnp.add, acc, g)
            jax.block_until_ready((loss, acc))
        return loss, acc


@dataclasses.dataclass
class StepStats:
    loss: float
    real_tokens: int
    padded_tokens: int
    seconds: float


class VarlenTrainer:
    """Training state on the home layout plus one runner per pipeline shape; `set_pipelines` switches."""

    def __init__(self, model_name: str, config, params, tx: optax.GradientTransformation,
                 cp_method=CpMethod.RING, runners: dict | None = None):
        """`runners` may be shared between trainers of the same model so compiled programs are reused."""
        self.model_name, self.config, self.tx, self.cp_method = model_name, config, tx, cp_method
        self.params, self.opt_state = params, jax.jit(tx.init)(params)
        self._runners: dict[PipelineMesh, PipelineRunner] = {} if runners is None else runners
        self.pipelines: list[PipelineMesh] = []
        self._update = jax.jit(self._apply)

    def _apply(self, params, opt_state, grads, inv_tokens):
        grads = jax.tree_util.tree_map(lambda g: g * inv_tokens, grads)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def runner(self, pm: PipelineMesh) -> PipelineRunner:
        if pm not in self._runners:
            self._runners[pm] = PipelineRunner(self.model_name, self.config, pm, self.params, self.cp_method)
        return self._runners[pm]

    def set_pipelines(self, pipelines: Sequence[PipelineMesh]) -> None:
        """Switch strategy: the state moves (exactly) to the new pipeline 0's layout."""
        if not pipelines:
            raise ConfigError("a strategy needs at least one pipeline")
        self.pipelines = list(pipelines)
        home = self.runner(self.pipelines[0])
        pshard, oshard = state_shardings(self.params, self.opt_state, home.mesh)
        self.params, self.opt_state = reshard(self.params, pshard), reshard(self.opt_state, oshard)

    @property
    def compile_s(self) -> float:
        return sum(r.compile_s for r in self._runners.values())

    def step(self, per_pipeline: Sequence[Sequence[dict]]) -> StepStats:
        """One step; `per_pipeline[p]` are pipeline p's micro-batches (dicts of int32/float32 [R,S])."""
        if len(per_pipeline) != len(self.pipelines):
            raise ConfigError(f"{len(per_pipeline)} micro-batch lists for {len(self.pipelines)} pipelines")
        runners = [self.runner(pm) for pm in self.pipelines]
        home = runners[0]
        for r, mbs in zip(runners, per_pipeline):  # compile outside the timed region
            for mb in mbs:
                r.compiled(reshard(self.params, r.pshard) if r is not home else self.params, mb["inputs"].shape)
        real = int(sum(float(mb["weights"].sum()) for mbs in per_pipeline for mb in mbs))
        slots = int(sum(mb["weights"].size for mbs in per_pipeline for mb in mbs))
        t0 = time.perf_counter()
        outs = []
        for r, mbs in zip(runners, per_pipeline):   # one after another (see PipelineRunner.grads)
            if mbs:
                outs.append(r.grads(reshard(self.params, r.pshard) if r is not home else self.params, mbs))
        if not outs:
            raise ConfigError("a step needs at least one micro-batch")
        loss = sum(reshard(l, NamedSharding(home.mesh, P())) for l, _ in outs)
        grads = None
        for _, g in outs:   # fixed pipeline order: the sum does not depend on timing
            g = reshard(g, home.pshard)
            grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        inv = jnp.float32(1.0 / max(real, 1))
        self.params, self.opt_state = self._update(self.params, self.opt_state, grads, inv)
        jax.block_until_ready(self.params)
        loss_v = float(loss) / max(real, 1)
        if not np.isfinite(loss_v):
            raise FloatingPointError(f"loss is {loss_v} (NaN/Inf) at this step")
        return StepStats(loss_v, real, slots, time.perf_counter() - t0)
