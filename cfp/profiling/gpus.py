"""GPU catalog for the `estimate` profiler: peak dense throughput, memory bandwidth and size, link bandwidth.

Figures are dense (no sparsity) peaks from the vendor datasheets/whitepapers; link bandwidth is per direction.
  A100-PCIe-40G, A100-SXM-80G: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TF, FP32 19.5 TF,
      1,555 / 2,039 GB/s HBM2(e); NVLink 600 GB/s total (300 per direction); PCIe Gen4 x16 64 GB/s (32 each way).
  H100-SXM: NVIDIA H100 datasheet: BF16 989 TF dense (1,979 with sparsity), FP32 67 TF, HBM3 3.35 TB/s, 80 GB,
      NVLink 900 GB/s total.
  H200: NVIDIA H200 datasheet (SXM): BF16 989 TF dense, FP32 67 TF, HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s.
  RTX 3090 / RTX 3080 Ti: NVIDIA Ampere GA102 whitepaper: FP16/BF16 tensor with FP32 accumulate 71 / 68.2 TF
      (GeForce runs FP32-accumulate at half the FP16-accumulate rate; dense), FP32 35.6 / 34.1 TF, 936 / 912 GB/s,
      24 / 12 GB GDDR6X; multi-GPU over PCIe Gen4 x16.
  RTX 4090: NVIDIA Ada Lovelace whitepaper: BF16 tensor FP32-accumulate 165.2 TF dense, FP32 82.6 TF,
      1,008 GB/s, 24 GB GDDR6X; PCIe Gen4 x16 (no NVLink).
"""
from __future__ import annotations

import dataclasses

from cfp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_tflops: float
    fp32_tflops: float
    mem_gbps: float        # GB/s device memory bandwidth
    mem_gb: float
    link_gbps: float       # GB/s per direction between GPUs of one node (NVLink where present, else PCIe)
    link: str

    def peak_flops(self, dtype: str) -> float:
        return 1e12 * (self.bf16_tflops if dtype in ("bfloat16", "float16") else self.fp32_tflops)


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("A100-PCIe-40G", 312.0, 19.5, 1555.0, 40.0, 32.0, "PCIe Gen4 x16"),
    GpuSpec("A100-SXM-80G", 312.0, 19.5, 2039.0, 80.0, 300.0, "NVLink 3"),
    GpuSpec("H100-SXM", 989.0, 67.0, 3350.0, 80.0, 450.0, "NVLink 4"),
    GpuSpec("H200", 989.0, 67.0, 4800.0, 141.0, 450.0, "NVLink 4"),
    GpuSpec("RTX3090", 71.0, 35.6, 936.0, 24.0, 32.0, "PCIe Gen4 x16"),
    GpuSpec("RTX4090", 165.2, 82.6, 1008.0, 24.0, 32.0, "PCIe Gen4 x16"),
    GpuSpec("RTX3080Ti", 68.2, 34.1, 912.0, 12.0, 32.0, "PCIe Gen4 x16"),
)}


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def get_gpu(name: str) -> GpuSpec:
    """Look up a catalog GPU; spaces, dashes and case are ignored ("rtx 3090" == "RTX3090")."""
    for g in GPUS.values():
        if _norm(g.name) == _norm(str(name)):
            return g
    raise ConfigError(f"unknown gpu {name!r}; known: {', '.join(GPUS)}")
