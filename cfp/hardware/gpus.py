"""The device catalog: peak dense throughput per precision, memory, memory bandwidth and the default link.

One catalog for every user (the profiling pass's `estimate` cost model, the heterogeneous-cluster planner, the
sequence-scheme cost fits). Every figure is a dense (no sparsity) peak from the source named in the entry's
`source`; where a datasheet quotes "with sparsity" figures only, the dense value is half of it. Link bandwidth is
per direction between two devices of one machine.

Sources:
  [A100]    NVIDIA A100 Tensor Core GPU datasheet (2021): FP32 19.5, TF32 156, BF16/FP16 312 TF; HBM2 40 GB
            1,555 GB/s (PCIe 40G), HBM2e 80 GB 1,935 GB/s (PCIe 80G) / 2,039 GB/s (SXM 80G); NVLink 600 GB/s total;
            PCIe Gen4 x16 64 GB/s total.
  [H100]    NVIDIA H100 Tensor Core GPU datasheet (2023): SXM FP32 67, TF32 989*, BF16 1,979*, FP8 3,958* TF;
            HBM3 80 GB 3.35 TB/s; NVLink 900 GB/s total. PCIe FP32 51, TF32 756*, BF16 1,513*, FP8 3,026* TF;
            HBM2e 80 GB 2 TB/s; PCIe Gen5 128 GB/s total. (* with sparsity: dense is half)
  [H200]    NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: same compute as H100 SXM; HBM3e 141 GB 4.8 TB/s;
            NVLink 900 GB/s total.
  [GA102]   NVIDIA Ampere GA102 GPU architecture whitepaper (v2.1), RTX 3090 / 3080 Ti: FP32 35.6 / 34.1,
            TF32 tensor 35.6 / 34.1, FP16 and BF16 tensor with FP32 accumulate 71 / 68.2 TF (dense); GDDR6X 24 GB
            936 GB/s / 12 GB 912 GB/s; PCIe Gen4 x16.
  [AD102]   NVIDIA Ada GPU architecture whitepaper (v2.02), RTX 4090: FP32 82.6, TF32 tensor 82.6, FP16/BF16
            tensor with FP32 accumulate 165.2, FP8 with FP32 accumulate 330.3 TF (dense); GDDR6X 24 GB 1,008 GB/s;
            PCIe Gen4 x16 (no NVLink).
  [L4]      NVIDIA L4 Tensor Core GPU datasheet (2023): FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485* TF;
            GDDR6 24 GB 300 GB/s; PCIe Gen4 x16. (* with sparsity)
  [V100]    NVIDIA V100 Tensor Core GPU datasheet (2020), SXM2 32 GB: FP32 15.7, FP16 tensor 125 TF (no TF32/BF16
            tensor cores: those dtypes run at the FP32 rate); HBM2 900 GB/s; NVLink 300 GB/s total.
  [cpu]     This machine's simulated XLA:CPU devices, measured by `benchmarks/calibrate_cpu.py --write`, which
            writes `cfp/hardware/cpu_calibration.py` (its figures, date, host and load are there). The devices
            share the host's cores (`shared_host`) and one intra-op thread pool: a single device's GEMM spreads
            over every core, so the host is one pool of compute that the busy devices divide. The calibration
            times each kernel by the CPU time of all the process's threads (stable under the other users'
            load, unlike wall time) and gives per-device figures for all devices busy: the host's cores times
            the per-core rate, over the device count. Its GEMM curve (`gemm_curve`) is fitted to GEMMs of the
            models' shapes: on a CPU a GEMM reaches its large-shape rate at far smaller dimensions than on a GPU.
            Its memory-bound rate has two values (`spill`): one for stage programs whose activations fit the
            effective last-level cache, one for those that do not, both fitted to the runtime's stage programs.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Mapping

from cfp.errors import ConfigError


class Precision(str, enum.Enum):
    """The arithmetic a dot runs in on the device (not its storage dtype)."""

    FP32 = "fp32"     # CUDA cores
    TF32 = "tf32"     # tensor cores, float32 storage
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One device type. `tflops` maps each supported precision to its dense peak (TFLOP/s)."""

    name: str
    tflops: tuple[tuple[Precision, float], ...]
    mem_gbps: float        # GB/s device memory bandwidth
    mem_gb: float
    link_gbps: float       # GB/s per direction between two devices of one machine
    link: str
    source: str
    # the machine's devices share one host's cores (simulated XLA:CPU devices): its throughput is divided
    # among the busy ones, so a pipeline's idle stages lend theirs to the others
    shared_host: bool = False
    # (large-GEMM fraction of `tflops`, half dimension) of an entry fitted to measured GEMMs; None: the
    # datasheet entries' curve of `cfp.hardware.rates`
    gemm_curve: tuple[float, float] | None = None
    # fixed seconds of one collective per device beyond its bytes (all devices busy); the datasheet entries
    # leave it to the link table's latencies (0 here)
    collective_latency_s: float = 0.0
    # GB/s of softmax passes (exp, counted as bytes read + written); None: `mem_gbps` (memory-bound, as on a
    # GPU); a CPU computes the exponentials well below its memory speed
    softmax_gbps: float | None = None
    # (cache bytes, GB/s): a program whose working set exceeds the cache bytes runs its memory-bound work at the
    # second rate instead of `mem_gbps` (a CPU's last-level cache: streaming through a working set larger
    # than an LRU cache misses on nearly every line, so the rate drops as a step); None: no cache term (on
    # the GPUs here an activation working set is far larger than L2, `mem_gbps` is the HBM rate)
    spill: tuple[float, float] | None = None
    # (major, minor) CUDA compute capability (NVIDIA's "CUDA GPUs" table); None: not a CUDA GPU, or not known.
    # Which attention kernels the runtime runs on it (`cfp.models.attention_select`), so what the planner
    # prices, depends on it
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self):
        table = dict(self.tflops)
        if Precision.FP32 not in table or any(v <= 0 for v in table.values()):
            raise ConfigError(f"gpu {self.name!r}: needs a positive FP32 peak, got {table}")
        for field in ("mem_gbps", "mem_gb", "link_gbps"):
            if not getattr(self, field) > 0:
                raise ConfigError(f"gpu {self.name!r}: {field}={getattr(self, field)!r} must be positive")
        if not self.collective_latency_s >= 0:
            raise ConfigError(f"gpu {self.name!r}: collective_latency_s={self.collective_latency_s!r} must be >= 0")
        if self.softmax_gbps is not None and not self.softmax_gbps > 0:
            raise ConfigError(f"gpu {self.name!r}: softmax_gbps={self.softmax_gbps!r} must be positive")
        if self.spill is not None and not (self.spill[0] > 0 and self.spill[1] > 0):
            raise ConfigError(f"gpu {self.name!r}: spill={self.spill!r} must be (cache bytes, GB/s), both positive")
        cc = self.compute_capability
        if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(x, int) for x in cc)):
            raise ConfigError(f"gpu {self.name!r}: compute_capability={cc!r} must be (major, minor) integers")
        if self.gemm_curve is not None and not (0 < self.gemm_curve[0] <= 1 and self.gemm_curve[1] >= 0):
            raise ConfigError(f"gpu {self.name!r}: gemm_curve={self.gemm_curve!r} must be (fraction in (0, 1], "
                              "half dimension >= 0)")

    def spills(self, working_set: float) -> bool:
        """Whether memory-bound work streaming through `working_set` bytes runs beyond the cache (`spill`)."""
        return self.spill is not None and working_set > self.spill[0]

    def mem_bandwidth(self, spilled: bool = False) -> float:
        """Bytes/s of memory-bound work, beyond the cache where `spilled` (`spills`; one rate without `spill`)."""
        return 1e9 * (self.spill[1] if spilled and self.spill is not None else self.mem_gbps)

    @property
    def softmax_bandwidth(self) -> float:
        """Bytes/s of softmax passes (`softmax_gbps`, else the memory bandwidth)."""
        return 1e9 * (self.softmax_gbps or self.mem_gbps)

    @property
    def peaks(self) -> Mapping[Precision, float]:
        return dict(self.tflops)

    def peak(self, precision: Precision) -> float:
        """Dense peak FLOP/s in `precision`; a precision the device lacks runs at its FP32 rate."""
        table = self.peaks
        return 1e12 * table.get(Precision(precision), table[Precision.FP32])

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of a dot whose operands are `dtype`, at float32 run as FP32 (CUDA cores)."""
        return self.peak(Precision.BF16 if dtype in ("bfloat16", "float16") else Precision.FP32)


def _gpu(name, *, fp32, tf32, bf16, fp8, mem_gbps, mem_gb, link_gbps, link, source, fp16=None,
         shared_host=False, gemm_curve=None, collective_latency_s=0.0, softmax_gbps=None, spill=None,
         cc=None) -> GpuSpec:
    table = {Precision.FP32: fp32, Precision.TF32: tf32, Precision.BF16: bf16, Precision.FP16: fp16 or bf16,
             Precision.FP8: fp8}
    return GpuSpec(name=name, tflops=tuple((p, v) for p, v in table.items() if v), mem_gbps=mem_gbps, mem_gb=mem_gb,
                   link_gbps=link_gbps, link=link, source=source, shared_host=shared_host, gemm_curve=gemm_curve,
                   collective_latency_s=collective_latency_s, softmax_gbps=softmax_gbps, spill=spill,
                   compute_capability=cc)


def _cpu() -> GpuSpec:
    """The catalog's `cpu` entry, from the figures `benchmarks/calibrate_cpu.py --write` measured
    (`cpu_calibration.CPU`): the fallback of this host's measured entry (`cfp.hardware.host_entry`)."""
    from cfp.hardware.cpu_calibration import CPU
    return cpu_spec(CPU)


def cpu_spec(CPU) -> GpuSpec:
    """The `cpu` device entry of a `CpuCalibration`'s figures (per device with all devices busy)."""
    per_device = CPU.cores / CPU.devices
    return _gpu("cpu", fp32=CPU.gemm_gflops_per_core * per_device / 1e3, tf32=None, bf16=None, fp8=None,
                mem_gbps=CPU.mem_gbps_per_core * per_device, mem_gb=CPU.host_memory_gb / CPU.devices,
                link_gbps=CPU.link_gbps_per_core * per_device, link="shared host memory", source="cpu",
                shared_host=True, gemm_curve=(1.0, CPU.gemm_half_dim),
                collective_latency_s=CPU.collective_cpu_us * 1e-6 / per_device,
                softmax_gbps=CPU.softmax_gbps_per_core * per_device,
                spill=(CPU.cache_mib * 2 ** 20, CPU.spilled_mem_gbps_per_core * per_device))


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    _gpu("A100-PCIe-40G", fp32=19.5, tf32=156.0, bf16=312.0, fp8=None, mem_gbps=1555.0, mem_gb=40.0, link_gbps=32.0,
         link="PCIe Gen4 x16", source="A100", cc=(8, 0)),
    _gpu("A100-PCIe-80G", fp32=19.5, tf32=156.0, bf16=312.0, fp8=None, mem_gbps=1935.0, mem_gb=80.0, link_gbps=32.0,
         link="PCIe Gen4 x16", source="A100", cc=(8, 0)),
    _gpu("A100-SXM-80G", fp32=19.5, tf32=156.0, bf16=312.0, fp8=None, mem_gbps=2039.0, mem_gb=80.0, link_gbps=300.0,
         link="NVLink 3", source="A100", cc=(8, 0)),
    _gpu("H100-SXM", fp32=67.0, tf32=494.5, bf16=989.0, fp8=1979.0, mem_gbps=3350.0, mem_gb=80.0, link_gbps=450.0,
         link="NVLink 4", source="H100", cc=(9, 0)),
    _gpu("H100-PCIe", fp32=51.0, tf32=378.0, bf16=756.5, fp8=1513.0, mem_gbps=2000.0, mem_gb=80.0, link_gbps=64.0,
         link="PCIe Gen5 x16", source="H100", cc=(9, 0)),
    _gpu("H200", fp32=67.0, tf32=494.5, bf16=989.0, fp8=1979.0, mem_gbps=4800.0, mem_gb=141.0, link_gbps=450.0,
         link="NVLink 4", source="H200", cc=(9, 0)),
    _gpu("RTX3090", fp32=35.6, tf32=35.6, bf16=71.0, fp8=None, mem_gbps=936.0, mem_gb=24.0, link_gbps=32.0,
         link="PCIe Gen4 x16", source="GA102", cc=(8, 6)),
    _gpu("RTX3080Ti", fp32=34.1, tf32=34.1, bf16=68.2, fp8=None, mem_gbps=912.0, mem_gb=12.0, link_gbps=32.0,
         link="PCIe Gen4 x16", source="GA102", cc=(8, 6)),
    _gpu("RTX4090", fp32=82.6, tf32=82.6, bf16=165.2, fp8=330.3, mem_gbps=1008.0, mem_gb=24.0, link_gbps=32.0,
         link="PCIe Gen4 x16", source="AD102", cc=(8, 9)),
    _gpu("L4", fp32=30.3, tf32=60.0, bf16=121.0, fp8=242.5, mem_gbps=300.0, mem_gb=24.0, link_gbps=32.0,
         link="PCIe Gen4 x16", source="L4", cc=(8, 9)),
    _gpu("V100-SXM2-32G", fp32=15.7, tf32=None, bf16=None, fp8=None, mem_gbps=900.0, mem_gb=32.0, link_gbps=150.0,
         link="NVLink 2", source="V100", cc=(7, 0), fp16=125.0),
    _cpu(),
)}


# The catalog GPU of estimates where the user names none (`cfp search --plan-out`, `autoshard`'s saved plans,
# `cfp data bench-planner`); the CLI's shared defaults (`cfp/cli/common.py`) take it from here.
DEFAULT_GPU = "A100-SXM-80G"


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def get_gpu(name: str) -> GpuSpec:
    """Look up a catalog device; spaces, dashes and case are ignored ("rtx 3090" == "RTX3090")."""
    for g in GPUS.values():
        if _norm(g.name) == _norm(str(name)):
            return g
    raise ConfigError(f"unknown gpu {name!r}; known: {', '.join(GPUS)}")
