"""Measure this machine's simulated XLA:CPU devices for the `cpu` entry of the device catalog
(`cfp.hardware.gpus`) and the links of `examples/clusters/local.yaml`.

All 8 devices work at once (each its own shard of one jitted program), as they do under a layout that uses
them all, so each figure is per device while all are busy (the devices share the host's cores):
  * GEMM rate: float32 [n, n] x [n, n] per device, 2 n^3 FLOPs;
  * memory bandwidth: `x * a + b` over 16 MiB of float32 per device, bytes read + written;
  * collectives: an all-reduce (`psum`) of B bytes over 2, 4 and 8 devices, fitted to
    t = latency + 2 (n-1)/n B / bandwidth (the ring model of `cfp.hardware.collectives`).
Medians of `--repeats` runs; prints the figures (measured) and the catalog values they give.

    PYTHONPATH=$PWD python benchmarks/calibrate_cpu.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def _median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))                      # compile and warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sharded(mesh, shape, dtype=jnp.float32):
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, P("d")))


def gemm_rate(mesh, n: int, repeats: int) -> float:
    """FLOP/s per device of an [n, n] x [n, n] float32 matmul, all devices at once."""
    k = mesh.devices.size
    a, b = _sharded(mesh, (k, n, n)), _sharded(mesh, (k, n, n))
    f = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))
    return 2 * n ** 3 / _median_seconds(f, (a, b), repeats)


def memory_bandwidth(mesh, elements: int, repeats: int) -> float:
    """Bytes/s per device (read + written) of an elementwise `x * a + b` in float32, all devices at once."""
    k = mesh.devices.size
    x = _sharded(mesh, (k, elements))
    f = jax.jit(lambda x: x * 1.0001 + 0.5)
    return 2 * 4 * elements / _median_seconds(f, (x,), repeats)


def all_reduce_time(n: int, nbytes: int, repeats: int) -> float:
    """Seconds of a psum of `nbytes` per device over the first `n` devices."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    x = _sharded(mesh, (n, nbytes // 4))
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    return _median_seconds(f, (x,), repeats)


def fit_link(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of t = latency + 2(n-1)/n B / bandwidth, least squares."""
    a = np.array([[1.0, 2 * (n - 1) / n * b] for n, b, _ in points])
    t = np.array([s for _, _, s in points])
    (lat, inv_bw), *_ = np.linalg.lstsq(a, t, rcond=None)
    return max(float(lat), 0.0), 1.0 / float(inv_bw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    print(f"{mesh.devices.size} {jax.devices()[0].platform} devices; host load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    rates = {n: gemm_rate(mesh, n, args.repeats) for n in (256, 512, 1024)}
    for n, r in rates.items():
        print(f"GEMM float32 {n}x{n}x{n}: {r / 1e9:.2f} GFLOP/s per device, all busy (measured)")
    bw = memory_bandwidth(mesh, 4 << 20, args.repeats)
    print(f"memory (x*a+b, 16 MiB float32 per device): {bw / 1e9:.2f} GB/s per device, all busy (measured)")
    points = [(n, b, all_reduce_time(n, b, args.repeats)) for n in (2, 4, 8) for b in (1 << 16, 1 << 20, 1 << 22)]
    for n, b, s in points:
        print(f"all-reduce {b / 2 ** 20:.3g} MiB over {n}: {s * 1e3:.3f} ms (measured)")
    lat, link = fit_link(points)
    print(f"all-reduce fit: latency {lat * 1e6:.0f} us, bandwidth {link / 1e9:.2f} GB/s (fitted)")
    print("catalog values: tflops fp32 %.4f, mem_gbps %.2f, link_gbps %.2f; local.yaml intra_bandwidth %.2fGB/s"
          % (rates[512] / 1e12, bw / 1e9, link / 1e9, link / 1e9))


if __name__ == "__main__":
    main()
