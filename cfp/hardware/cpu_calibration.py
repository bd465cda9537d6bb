"""This machine's XLA:CPU devices as `benchmarks/calibrate_cpu.py --write` measured them (the `cpu`
entry of `cfp.hardware.gpus` and the "shared host memory" link of `cfp.hardware.collectives` read them).

Measured 2026-11-27 15:23 UTC on AMD EPYC (2 cores, 8 devices), host load average 2.7, `python
benchmarks/calibrate_cpu.py --repeats 9 --write`.
"""
from __future__ import annotations

from cfp.hardware.calibration import CpuCalibration

CPU = CpuCalibration(
    cores=2,
    devices=8,
    gemm_gflops_per_core=50.64,
    gemm_half_dim=23.5,
    mem_gbps_per_core=4.7,
    cache_mib=21.1,
    spilled_mem_gbps_per_core=2.04,
    softmax_gbps_per_core=5.66,
    link_gbps_per_core=4.159,
    collective_cpu_us=28.4,
    host_memory_gb=25.3,
)
