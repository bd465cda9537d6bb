"""This machine's XLA:CPU devices as `benchmarks/calibrate_cpu.py --write` measured them (the `cpu`
entry of `cfp.hardware.gpus` and the "shared host memory" link of `cfp.hardware.collectives` read them).

Measured 2026-11-25 11:45 UTC on AMD EPYC (2 cores, 8 devices), host load average 16.6, `python
benchmarks/calibrate_cpu.py --repeats 9 --write`.
"""
from __future__ import annotations

from cfp.hardware.calibration import CpuCalibration

CPU = CpuCalibration(
    cores=2,
    devices=8,
    gemm_gflops_per_core=96.82,
    gemm_half_dim=23.0,
    mem_gbps_per_core=4.98,
    softmax_gbps_per_core=19.21,
    link_gbps_per_core=17.281,
    collective_cpu_us=34.3,
    host_memory_gb=25.3,
)
