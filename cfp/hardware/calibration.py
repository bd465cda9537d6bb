"""The figures that describe this machine's XLA:CPU devices; `cfp/hardware/cpu_calibration.py` holds the
measured values (`benchmarks/calibrate_cpu.py --write` rewrites that file, never this one)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuCalibration:
    """Per core-second figures (CPU time of all threads) of the host that the `devices` simulated devices share."""
    cores: int                    # host cores the devices share
    devices: int                  # simulated XLA:CPU devices (--xla_force_host_platform_device_count)
    gemm_gflops_per_core: float   # float32 GEMM, large shapes
    gemm_half_dim: float          # a GEMM dimension of this size halves that dimension's factor
    mem_gbps_per_core: float      # elementwise bytes read + written, as a layer's norms, residuals... run
                                  # in a stage program whose activations fit `cache_mib`
    cache_mib: float              # effective last-level cache: the stage working set where the rate drops
    spilled_mem_gbps_per_core: float  # the elementwise rate of stage programs whose activations exceed it
    softmax_gbps_per_core: float  # softmax passes (exp), counted as bytes
    link_gbps_per_core: float     # all-reduce, ring-model bytes
    collective_cpu_us: float      # fixed CPU time of one collective per device taking part
    host_memory_gb: float         # host memory the devices share
