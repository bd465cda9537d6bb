"""How the priced training step runs: the runtime features the planner's cost model (`cfp.planner.costmodel`)
prices beyond the model's own figures.

The defaults are cfp's own runtime (each stage's recompute policy the least recomputation whose kept activations
fit its memory, `Recompute.AUTO`; attention as the runtime chooses it on the cluster's GPUs,
`runtime_fuses_attention`: fused where cuDNN runs it, else scores materialised; every pipeline's gradients gathered onto every
stage and summed, nothing overlapped), which is what `cfp plan` prices. Other values describe runs of other systems priced through the same cost floor, e.g. the
published runs `benchmarks/validate_costmodel.py` checks the model against: no recomputation, fused (flash)
attention, gradients all-reduced (DDP, Megatron) or parameters sharded across the data-parallel pipelines (FSDP,
ZeRO-3), data-parallel traffic overlapped with compute.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from cfp.errors import ConfigError
from cfp.hardware.collectives import collective_time
from cfp.hardware.gpus import GpuSpec
from cfp.models.attention_select import DeviceKind, Impl, config_case, decide_for
from cfp.models.configs import CONFIG_CLASSES
from cfp.recompute import POLICIES, Recompute


class GradSync(str, enum.Enum):
    GATHER = "gather"          # cfp's runtime: each stage gathers every pipeline's gradients and sums them
    ALL_REDUCE = "all-reduce"  # ring all-reduce of each stage's gradients across pipelines (DDP, Megatron)
    SHARDED = "sharded"        # FSDP / ZeRO-3: parameters and optimizer state sharded across the pipelines;
    #                            per micro-batch an all-gather of the parameters in the forward and again in
    #                            the backward, per step a reduce-scatter of the gradients


class Among(NamedTuple):
    """A pipeline's place in a layout of `n` pipelines: `updates` for pipeline 0, which under cfp's gather sync
    alone sums every pipeline's gradients, holds the optimizer state and runs the update; the others hold their
    parameters and accumulator and take pipeline 0's new parameters (`cfp.runtime.engine`). Where a count is
    given as a plain int it is pipeline 0's place (`among`)."""
    n: int
    updates: bool = True


def among(n_pipes: "int | Among") -> Among:
    """`n_pipes` as an `Among` (an int: pipeline 0 among that many)."""
    return n_pipes if isinstance(n_pipes, Among) else Among(int(n_pipes))


def _enum(cls, value, what):
    try:
        return cls(value)
    except ValueError:
        raise ConfigError(f"{what}={value!r} is not one of {', '.join(v.value for v in cls)}") from None


@dataclass(frozen=True)
class StepFeatures:
    """Runtime features of the priced step (defaults: cfp's runtime). `grad_bytes`: bytes per gradient element
    sent by the data-parallel sync; `overlap_grad_sync`: that traffic runs under the forward-backward compute;
    `fused_attention`: True/False prices fused (flash) or materialised attention, None what cfp's runtime runs
    on the cluster's GPUs (`attention_fused`)."""
    recompute: Recompute = Recompute.AUTO     # one policy for every stage, or AUTO: per stage (`CostModel`)
    fused_attention: bool | None = None
    grad_sync: GradSync = GradSync.GATHER
    grad_bytes: int = 4
    overlap_grad_sync: bool = False

    def __post_init__(self):
        object.__setattr__(self, "recompute", _enum(Recompute, self.recompute, "recompute"))
        object.__setattr__(self, "grad_sync", _enum(GradSync, self.grad_sync, "grad_sync"))
        if self.grad_bytes not in (2, 4):
            raise ConfigError(f"grad_bytes={self.grad_bytes!r} must be 2 (16-bit gradients) or 4 (float32)")
        if self.fused_attention is not None and not isinstance(self.fused_attention, bool):
            raise ConfigError(f"fused_attention={self.fused_attention!r} must be True, False or None (as the "
                              "runtime chooses)")
        if not isinstance(self.overlap_grad_sync, bool):
            raise ConfigError(f"overlap_grad_sync={self.overlap_grad_sync!r} must be True or False")

    def attention_fused(self, config, cluster) -> bool:
        """Whether `config`'s attention is priced fused on `cluster`: `fused_attention` where given, else the
        runtime's choice (`runtime_fuses_attention`)."""
        if self.fused_attention is not None:
            return self.fused_attention
        return runtime_fuses_attention(config, cluster)

    @property
    def policies(self) -> tuple[Recompute, ...]:
        """The policies a stage may be priced with, least recomputation first (AUTO: the first that fits)."""
        return POLICIES if self.recompute is Recompute.AUTO else (self.recompute,)

    def state_share(self, n_pipes: "int | Among") -> float:
        """Share of a stage's parameters (and, where it holds it, optimizer state) each device holds."""
        return 1.0 / among(n_pipes).n if self.grad_sync is GradSync.SHARDED else 1.0

    def optimizer_share(self, n_pipes: "int | Among") -> float:
        """Share of a stage's optimizer state each device of a pipeline at `n_pipes` holds: under the gather
        sync only pipeline 0's stages hold it (none on the others), else every pipeline its `state_share`."""
        place = among(n_pipes)
        if self.grad_sync is GradSync.GATHER and not place.updates and place.n > 1:
            return 0.0
        return self.state_share(place)

    def gathered_copies(self, n_pipes: "int | Among") -> int:
        """Parameter-sized buffers a stage receives after its backward beside its parameters and accumulator:
        under the gather sync pipeline 0's stages the other pipelines' gradients (n - 1), the others' pipeline
        0's new parameters (1, `cfp.runtime.executor.broadcast_params`); 0 under the other syncs."""
        place = among(n_pipes)
        if self.grad_sync is not GradSync.GATHER or place.n == 1:
            return 0
        return place.n - 1 if place.updates else 1

    def step_seconds(self, compute: float, sync: float, update: float) -> float:
        return (max(compute, sync) if self.overlap_grad_sync else compute + sync) + update


CFP_RUNTIME = StepFeatures()


def device_kind(gpu: GpuSpec) -> DeviceKind:
    """The device kind the attention chooser sees for a catalog entry: a CPU for the simulated host devices,
    a CUDA GPU of its compute capability, else a GPU it knows nothing of (no fused path)."""
    if gpu.shared_host:
        return DeviceKind("cpu")
    return DeviceKind("gpu", gpu.compute_capability)


def runtime_fuses_attention(config, cluster) -> bool:
    """Whether cfp's runtime runs `config`'s unpacked rows through fused attention on `cluster`: the chooser's
    decision (`cfp.models.attention_select.decide_for`) for its GPUs, the config's dtype and head dim. A
    model that is not a zoo config (derived `ModelFigures`) runs its own attention: not fused. One decision
    for the whole cluster, as one program traced for all its kinds gets (a cluster mixing kinds the chooser
    treats differently is priced with materialised scores everywhere; docs/limits.md)."""
    if not isinstance(config, tuple(CONFIG_CLASSES.values())):
        return False
    kinds = [device_kind(m.gpu) for m in cluster.machines]
    return decide_for(kinds, config_case(config, packed=False)).impl is Impl.CUDNN


def backward_passes(policy: Recompute) -> int:
    """A stage's backward in forward-compute units beyond what `selective` recomputes: the gradients (2x), plus
    the recomputed forward under `full` (as the runtime runs it: `none` and `selective` keep the forward's
    values, `cfp.ir.backward_split`)."""
    return 3 if policy is Recompute.FULL else 2


def collective_sync_seconds(features: StepFeatures, stage_params: float, n: int, chunks: int,
                            param_bytes: float, bw: float) -> float:
    """Seconds of one stage's data-parallel collectives per step under an all-reduce or sharded sync, for a
    device holding `stage_params` parameters (unsharded count) among `n` pipelines over links of `bw` bytes/s."""
    grads = stage_params * features.grad_bytes
    if features.grad_sync is GradSync.ALL_REDUCE:
        return collective_time("all-reduce", grads, n, bw)
    if features.grad_sync is GradSync.SHARDED:
        gathers = 2 * chunks * collective_time("all-gather", stage_params * param_bytes, n, bw)
        return gathers + collective_time("reduce-scatter", grads, n, bw)
    raise ConfigError(f"grad_sync={features.grad_sync.value!r} is priced by the cost model's own gather sync")
