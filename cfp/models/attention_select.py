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

`decide` (`choose`: its `Impl`) decides from a `DeviceKind` (a device's platform and compute capability,
`DeviceKind.of` a JAX device) and an `AttentionCase` (dtype, head dim, causal, packed), with the reason the
run's header prints (`header_line`), so every path's choice is testable on a CPU. It is the one place the
decision is made: the zoo's attention (`cfp.models.attention.attend`, `zoo_attend`: chosen at trace time for
this process's devices or an `on_devices` scope), the run headers of `cfp train` and `cfp data train`, and the
planner's pricing of attention (`cfp.planner.step_features.runtime_fuses_attention`) all ask it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from cfp.errors import ConfigError
from cfp.models.attention import attention_block, dense_attention
from cfp.models.packed_attention import packed_causal_attention

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


XLA_DEVICE = DeviceKind("cpu")      # a device without fused kernels: what `dot_product_attention` runs


def _cudnn_refusal(device: DeviceKind, case: AttentionCase) -> str | None:
    """Why cuDNN's fused attention does not run `case` on `device` (the module docstring's limits); None
    where it does."""
    cc = device.compute_capability
    if device.platform != "gpu":
        return f"{device.platform} devices"
    if cc is None:
        return "a GPU without a CUDA compute capability (not CUDA)"
    if cc < MIN_CAPABILITY:
        return f"compute capability {_cc(cc)}: cuDNN's flash attention needs {_cc(MIN_CAPABILITY)} or later"
    if cc == (10, 3) and (device.cudnn_version or 0) < CUDNN_FOR_10_3:
        return f"compute capability 10.3 needs cuDNN {CUDNN_FOR_10_3} or later, {device.cudnn_version} known"
    head_max = 256 if cc >= HOPPER else 128
    if case.dtype not in CUDNN_DTYPES:
        return f"{case.dtype} rows: cuDNN fuses {' and '.join(CUDNN_DTYPES)} only"
    if case.head_dim > head_max or case.head_dim % 8:
        return f"head dim {case.head_dim}: cuDNN needs a multiple of 8 up to {head_max} on {_cc(cc)}"
    if case.value_head_dim not in (None, case.head_dim):
        return f"value head dim {case.value_head_dim} differs from the query's {case.head_dim}"
    return None


def _cc(cc: tuple[int, int]) -> str:
    return f"sm {cc[0]}.{cc[1]}"


def cudnn_supports(device: DeviceKind, case: AttentionCase) -> bool:
    """Whether cuDNN's fused attention runs `case` on `device` (the module docstring's limits)."""
    return _cudnn_refusal(device, case) is None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation a row runs and why, as the run's header prints it (`str`)."""
    impl: Impl
    why: str

    def __str__(self) -> str:
        return f"attention: {self.impl.value} ({self.why})"


def decide(device: DeviceKind, case: AttentionCase) -> Choice:
    """cuDNN for unpacked causal rows it supports; the packed block kernel for packed causal rows of two
    blocks or more; the dense XLA path otherwise -- with the reason."""
    if case.causal and case.packed:
        block = attention_block(case.seq_len)
        if block < case.seq_len:
            return Choice(Impl.PACKED_BLOCKS, f"packed causal rows of {case.seq_len} tokens: only the "
                                              f"{block}-token blocks some sequence spans")
        return Choice(Impl.XLA, f"dense; a packed row of {case.seq_len} tokens is one block")
    if not case.causal:
        return Choice(Impl.XLA, "dense; bidirectional rows: the fused path is chosen for causal rows only")
    refusal = _cudnn_refusal(device, case)
    if refusal is not None:
        return Choice(Impl.XLA, f"dense; {refusal}")
    return Choice(Impl.CUDNN, f"fused; unpacked causal {case.dtype} rows, head dim {case.head_dim}, on "
                              f"{_cc(device.compute_capability)}")


def choose(device: DeviceKind, case: AttentionCase) -> Impl:
    """The implementation `decide` picks."""
    return decide(device, case).impl


def decide_for(devices: Sequence[DeviceKind], case: AttentionCase) -> Choice:
    """The choice for one program traced for all of `devices`: theirs where every kind decides alike, else
    the dense path (the one every device runs; it says which kinds disagreed)."""
    kinds = list(dict.fromkeys(devices))
    if not kinds:
        raise ConfigError("decide_for: no devices")
    choices = [decide(k, case) for k in kinds]
    if len({c.impl for c in choices}) == 1:
        return choices[0]
    parts = "; ".join(f"{_kind_text(k)}: {c.impl.value}" for k, c in zip(kinds, choices))
    return Choice(Impl.XLA, f"dense; one program for devices that differ ({parts})")


def _kind_text(kind: DeviceKind) -> str:
    return _cc(kind.compute_capability) if kind.compute_capability else kind.platform


_DEVICES: contextvars.ContextVar[Optional[tuple[DeviceKind, ...]]] = contextvars.ContextVar("cfp_attention_devices",
                                                                                             default=None)


@contextlib.contextmanager
def on_devices(kinds: Sequence[DeviceKind]):
    """Within this scope (at trace time) the zoo's attention is chosen for `kinds`, not this process's devices
    (e.g. a program compiled for other devices than the local ones)."""
    token = _DEVICES.set(tuple(kinds))
    try:
        yield
    finally:
        _DEVICES.reset(token)


def current_kinds() -> tuple[DeviceKind, ...]:
    """The device kinds the zoo's attention is chosen for: `on_devices`' scope, else this process's devices
    (every program a process compiles runs on its own devices)."""
    scoped = _DEVICES.get()
    return scoped if scoped is not None else tuple(DeviceKind.of(d) for d in jax.local_devices())


def config_case(config, packed: bool) -> AttentionCase:
    """The case of a zoo config's attention over rows of `config.seq_len` (BERT's is bidirectional)."""
    from cfp.models.configs import BertConfig
    return AttentionCase(config.dtype, config.seq_len, config.head_dim, not isinstance(config, BertConfig),
                         packed)


def header_line(config, packed: bool) -> str:
    """The run header's line: the attention the zoo model of `config` runs on this process's devices."""
    if config is None:
        return "attention: the model's own (not a zoo model)"
    return str(decide_for(current_kinds(), config_case(config, packed)))


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
    if impl is Impl.PACKED_BLOCKS:
        if segment_ids is None:
            raise ConfigError("Impl.PACKED_BLOCKS needs the rows' segment ids")
        return packed_causal_attention(q, k, v, segment_ids, attention_block(q.shape[1]))
    return dense_attention(q, k, v, causal, segment_ids)


def zoo_attend(q, k, v, causal: bool, segment_ids=None):
    """The zoo's attention outside context parallelism: the implementation chosen for `current_kinds()`."""
    impl = decide_for(current_kinds(), case_of(q, v, causal, segment_ids)).impl
    return attend(impl, q, k, v, causal, segment_ids)
