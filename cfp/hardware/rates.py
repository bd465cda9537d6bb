"""Achievable rates of one device: which arithmetic a dot runs in, and how fast a GEMM of a given shape runs.

`dot_precision(dtype, matmul_precision, gpu)` decides the arithmetic from the operands' storage dtype and JAX's
matmul precision: on GPUs with tensor cores JAX's default precision runs float32 dots as TF32 (XLA:GPU lets
cuBLAS use TF32 unless the precision is HIGHEST; JAX docs, `jax.default_matmul_precision`), bfloat16/float16 run
on BF16/FP16 tensor cores and float8 types on FP8 ones; a precision the device lacks runs at its FP32 rate.

`achievable_flops(gpu, precision, m, n, k)` is the dense peak times the fraction a library GEMM of that shape
reaches. The fraction is `GEMM_EFFICIENCY[precision]` for large GEMMs, times d/(d + HALF_DIM) for each of
m, n, k: a GEMM with a dimension of HALF_DIM runs at half the large-GEMM rate (tile and wave quantisation and
too little work per SM). Source of both: NVIDIA, "Matrix Multiplication Background User's Guide"
(DU-09799-001, Feb 2023), sec. 2.3 and 3: cuBLAS 11 on A100 reaches about 250 of 312 TFLOP/s (0.8) in FP16
for M=N=K >= 4096 and falls off steeply below ~256 per dimension; CUDA-core FP32 SGEMM reaches ~0.9 of its
peak. A device entry measured rather than read off a datasheet (the `cpu` entry, `GpuSpec.gemm_curve`) brings
its own large-GEMM fraction and half dimension, fitted to its measured GEMMs. These are large-GEMM figures;
fused attention, layer norms and elementwise ops are memory bound (`memory_time`).
"""
from __future__ import annotations

import enum

from cfp.errors import ConfigError
from cfp.hardware.gpus import GpuSpec, Precision

HALF_DIM = 64.0
GEMM_EFFICIENCY = {Precision.FP32: 0.90, Precision.TF32: 0.80, Precision.BF16: 0.80, Precision.FP16: 0.80,
                   Precision.FP8: 0.70}


class MatmulPrecision(str, enum.Enum):
    """JAX's `jax_default_matmul_precision` / `lax.Precision` for float32 dots."""

    DEFAULT = "default"          # TF32 on tensor-core GPUs
    HIGH = "high"                # bf16_3x on TPU; TF32 on XLA:GPU
    HIGHEST = "highest"          # true float32
    TENSORFLOAT32 = "tensorfloat32"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


_EXACT = (MatmulPrecision.HIGHEST, MatmulPrecision.FLOAT32)
_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz")


def parse_matmul_precision(value) -> MatmulPrecision:
    if value is None:
        return MatmulPrecision.DEFAULT
    try:
        return MatmulPrecision(str(getattr(value, "name", value)).lower())
    except ValueError:
        raise ConfigError(f"matmul precision {value!r} is not one of "
                          f"{', '.join(p.value for p in MatmulPrecision)}") from None


def dot_precision(dtype: str, matmul_precision=None, gpu: GpuSpec | None = None) -> Precision:
    """The arithmetic a dot with operands of `dtype` runs in on `gpu` under JAX's `matmul_precision`."""
    dtype, mp = str(dtype), parse_matmul_precision(matmul_precision)
    has = (lambda p: p in gpu.peaks) if gpu is not None else (lambda p: True)
    if dtype in _FP8:
        want = Precision.FP8
    elif dtype == "bfloat16":
        want = Precision.BF16
    elif dtype == "float16":
        want = Precision.FP16
    elif dtype in ("float32", "float64"):
        if dtype == "float64" or mp in _EXACT:
            return Precision.FP32
        want = Precision.BF16 if mp is MatmulPrecision.BFLOAT16 else Precision.TF32
    else:
        raise ConfigError(f"dtype {dtype!r} of a dot is not one of float32, float64, bfloat16, float16, "
                          f"{', '.join(_FP8)}")
    # a device without that unit: FP8 falls back to 16-bit tensor cores, everything else to CUDA cores
    for p in ((want, Precision.FP16, Precision.BF16) if want is Precision.FP8 else (want,)):
        if has(p):
            return p
    return Precision.FP32


def gemm_efficiency(precision: Precision, m: float, n: float, k: float, gpu: GpuSpec | None = None) -> float:
    """Fraction of the dense peak a library GEMM of (m x k) @ (k x n) reaches (see the module docstring);
    `gpu`'s own curve where its entry was fitted to measured GEMMs (`GpuSpec.gemm_curve`)."""
    if min(m, n, k) <= 0:
        raise ConfigError(f"GEMM shape ({m}, {n}, {k}) must be positive")
    large, half = (GEMM_EFFICIENCY[Precision(precision)], HALF_DIM)
    if gpu is not None and gpu.gemm_curve is not None:
        large, half = gpu.gemm_curve
    shape = 1.0
    for d in (m, n, k):
        shape *= d / (d + half)
    return large * shape


def achievable_flops(gpu: GpuSpec, precision: Precision, m: float = 8192, n: float = 8192,
                     k: float = 8192) -> float:
    """FLOP/s a GEMM of shape (m, n, k) reaches on `gpu` in `precision` (default: a large square GEMM)."""
    return gpu.peak(precision) * gemm_efficiency(precision, m, n, k, gpu)


def dot_time(flops: float, gpu: GpuSpec, dtype: str, matmul_precision=None, shape=(8192, 8192, 8192)) -> float:
    """Seconds of a dot of `flops` FLOPs with operands of `dtype` and GEMM shape (m, n, k)."""
    return flops / achievable_flops(gpu, dot_precision(dtype, matmul_precision, gpu), *shape)


def memory_time(nbytes: float, gpu: GpuSpec) -> float:
    """Seconds to move `nbytes` through device memory (memory-bound ops)."""
    return nbytes / (gpu.mem_gbps * 1e9)
