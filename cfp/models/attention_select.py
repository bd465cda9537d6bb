"""Which attention implementation a row runs, chosen in one place (issue 39 item 2).

* `Impl.CUDNN`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash attention (no
  materialised scores), for unpacked causal rows on CUDA GPUs whose dtype and head dim it supports. The limits
  are JAX 0.12's own checks (`check_is_flash_attention` in its cuDNN fused-attention module): float16 or
  bfloat16, head dim a multiple of 8 and at most 128 (256 from Hopper, compute capability 9.0), query and value
  head dims equal (other head dims need cuDNN >= 9.10 on Hopper); compute capability 10.3 needs cuDNN >= 9.11;
  cuDNN's flash attention runs from Ampere (8.0) on (cuDNN frontend documentation).
* `Impl.PACKED_BLOCKS`: `cfp.models.packed_attention` (XLA), packed causal rows of at least two blocks: only
  the blocks some sequence spans. cuDNN's packed (THD) layout is reachable only through JAX internals
  (`q_offsets`) and is not chosen here.
* `Impl.XLA`: the dense path of `cfp.models.attention.dot_product_attention` (float32 scores of the whole row).

`choose` decides from a `DeviceKind` (a device's platform and compute capability, `DeviceKind.of` a JAX
device) and an `AttentionCase` (dtype, head dim, causal, packed), so every path's choice is testable on a CPU.
"""
from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from cfp.errors import ConfigError
from cfp.models.attention import attention_block, dot_product_attention

CUDNN_DTYPES = ("float16", "bfloat16")
MIN_CAPABILITY = (8, 0)          # cuDNN flash attention: Ampere and later
HOPPER = (9, 0)                  # head dims up to 256 (128 before)
CUDNN_FOR_10_3 = 91100           # compute capability 10.3 needs cuDNN 9.11+


class Impl(enum.Enum):
    CUDNN = "cudnn"
    PACKED_BLOCKS = "packed-blocks"
    XLA = "xla"


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """`platform`: "cpu", "gpu", "tpu"; `compute_capability`: (major, minor) of a CUDA GPU, None otherwise
    (ROCm GPUs, CPUs, TPUs); `cudnn_version` as cuDNN reports it (e.g. 91100), None if unknown."""
    platform: str
    compute_capability: tuple[int, int] | None = None
    cudnn_version: int | None = None

    def __post_init__(self):
        if self.platform not in ("cpu", "gpu", "tpu"):
            raise ConfigError(f"DeviceKind.platform={self.platform!r} is not one of cpu, gpu, tpu")
        cc = self.compute_capability
        if cc is not None and (len(cc) != 2 or not all(isinstance(x, int) and x >= 0 for x in cc)):
            raise ConfigError(f"DeviceKind.compute_capability={cc!r} must be (major, minor) integers")

    @classmethod
    def of(cls, device) -> "DeviceKind":
        """A JAX device's kind (CUDA devices carry `compute_capability`, e.g. "9.0")."""
        cc = getattr(device, "compute_capability", None)
        return cls(device.platform, tuple(int(x) for x in str(cc).split(".")[:2]) if cc else None)


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One attention call: q's dtype, the row length, query and value head dims, causal, packed (segment ids)."""
    dtype: str
    seq_len: int
    head_dim: int
    causal: bool
    packed: bool
    value_head_dim: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        for f in ("seq_len", "head_dim"):
            if getattr(self, f) < 1:
                raise ConfigError(f"AttentionCase.{f}={getattr(self, f)!r} must be >= 1")


def cudnn_supports(device: DeviceKind, case: AttentionCase) -> bool:
    """Whether cuDNN's fused attention runs `case` on `device` (the module docstring's limits)."""
    cc = device.compute_capability
    if device.platform != "gpu" or cc is None or cc < MIN_CAPABILITY:
        return False
    if cc == (10, 3) and (device.cudnn_version or 0) < CUDNN_FOR_10_3:
        return False
    head_max = 256 if cc >= HOPPER else 128
    same_dims = case.value_head_dim in (None, case.head_dim)
    return (case.dtype in CUDNN_DTYPES and case.head_dim <= head_max and case.head_dim % 8 == 0
            and same_dims)


def choose(device: DeviceKind, case: AttentionCase) -> Impl:
    """cuDNN for unpacked causal rows it supports; the packed block kernel for packed causal rows of two
    blocks or more; the dense XLA path otherwise."""
    if case.causal and not case.packed and cudnn_supports(device, case):
        return Impl.CUDNN
    if case.causal and case.packed and attention_block(case.seq_len) < case.seq_len:
        return Impl.PACKED_BLOCKS
    return Impl.XLA


def case_of(q, v, causal: bool, segment_ids=None) -> AttentionCase:
    """The case of q [B,S,H,D], v [B,T,Hkv,Dv]."""
    return AttentionCase(jnp.dtype(q.dtype).name, q.shape[1], q.shape[3], causal, segment_ids is not None,
                         v.shape[3])


def attend(impl: Impl, q, k, v, causal: bool, segment_ids=None, fused_implementation: str = "cudnn"):
    """Run `impl` on q [B,S,H,D], k/v [B,T,Hkv,D]. `fused_implementation`: what `Impl.CUDNN` passes to
    `jax.nn.dot_product_attention` ("xla" runs the same call through XLA, e.g. to check it on a CPU)."""
    if impl is Impl.CUDNN:
        if segment_ids is not None:
            raise ConfigError("Impl.CUDNN runs unpacked rows only: got segment ids")
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=fused_implementation)
    if impl is Impl.PACKED_BLOCKS and segment_ids is None:
        raise ConfigError("Impl.PACKED_BLOCKS needs the rows' segment ids")
    return dot_product_attention(q, k, v, causal, segment_ids)
