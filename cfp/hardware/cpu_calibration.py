"""This machine's XLA:CPU devices as `benchmarks/calibrate_cpu.py --write` measured them (the `cpu`
entry of `cfp.hardware.gpus` and the "shared host memory" link of `cfp.hardware.collectives` read them).

Measured 2026-11-25 14:43 UTC on AMD EPYC (2 cores, 8 devices), host load average 1.6, `python
benchmarks/calibrate_cpu.py --repeats 9 --write`.
"""
from __future__ import annotations

from cfp.hardware.calibration import CpuCalibration

CPU = CpuCalibration(
    cores=2,
    devices=8,
    gemm_gflops_per_core=95.59,
    gemm_half_dim=20.0,
    mem_gbps_per_core=17.76,
    cache_mib=21.1,
    spilled_mem_gbps_per_core=3.81,
    softmax_gbps_per_core=16.83,
    link_gbps_per_core=11.866,
    collective_cpu_us=22.8,
    host_memory_gb=25.3,
)
