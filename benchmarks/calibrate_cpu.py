"""Measure this machine's simulated XLA:CPU devices for the `cpu` entry of the device catalog
(`cfp.hardware.gpus`, read from `cfp/hardware/cpu_calibration.py`, which `--write` rewrites: the documented
fallback of the host entry `cfp plan` measures and caches itself, `cfp.hardware.host_entry`). The measurement is
`cfp.hardware.host_measure`'s at its full size (the host entry's first use runs its quick size).

Every kernel is timed by the CPU time of all the process's threads (`time.process_time`), not wall time: the
devices share the host's cores and one intra-op thread pool (one device's GEMM spreads over every core), so
a kernel's CPU time is the work it gives the host, and it does not grow when other users load the host the
way wall time does (measured here: wall time 3x the CPU time at load average 11, CPU time within 5% between
runs). Figures are per core-second; the catalog's per-device figures are cores x per-core / devices.

  * GEMM: float32 (m x k) @ (k x n) on one device for the projection and attention shapes of the zoo's small
    configs, fitted to rate = R d1 d2 d3 / prod(d + H) (`cfp.hardware.rates`) by least squares in log space;
  * softmax: float32 over [b, 128, 128] scores, counted as the cost model counts its bytes (4 passes);
  * the rest of the elementwise work (norms, residuals, activations, RoPE): the rate at which the cost model's
    stage time fits the measured forward + backward of a one-layer Llama-2 "small" stage at 1-8 sequences
    (the runtime's compiled programs, one copy per core at once), its GEMMs and softmax at the rates above: two
    rates, either side of the working set where it drops (the effective last-level cache, fitted); a plain
    `x * a + b` over 1 and 4 MiB per device is printed beside it for reference;
  * all-reduce: a psum of B bytes over 2, 4 and 8 devices; its CPU time as the per-device time of all
    devices busy (x devices / (n cores)) is fitted to t = latency + 2(n-1)/n B / bandwidth (the ring model of
    `cfp.hardware.collectives` plus a fixed cost per collective: on a CPU a collective is a rendezvous of
    threads and memory copies).
Medians of `--repeats` runs. Prints the figures (measured), the fits and the catalog values they give.

    PYTHONPATH=$PWD python benchmarks/calibrate_cpu.py [--repeats 9] [--micro-batches 1,2,3,4,5,6,8] [--write]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import textwrap

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from cfp.hardware import host_measure as hm  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cfp", "hardware", "cpu_calibration.py")
STAGE_MICRO_BATCHES = hm.STAGE_MICRO_BATCHES


def write(path: str, figures: dict, note: str) -> None:
    body = "\n".join(f"    {k}={v!r}," for k, v in figures.items())
    from cfp.files import write_text_atomic
    write_text_atomic(path, f'''"""This machine's XLA:CPU devices as `benchmarks/calibrate_cpu.py --write` measured them (the `cpu`
entry of `cfp.hardware.gpus` and the "shared host memory" link of `cfp.hardware.collectives` read them).

{note}
"""
from __future__ import annotations

from cfp.hardware.calibration import CpuCalibration

CPU = CpuCalibration(
{body}
)
''')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--write", action="store_true", help=f"write the figures to {os.path.relpath(OUT)}")
    ap.add_argument("--micro-batches", default=",".join(map(str, STAGE_MICRO_BATCHES)),
                    help="the stage's micro-batch sizes timed (the stage fit: a cache split needs 2+ either side)")
    args = ap.parse_args()
    try:
        micro_batches = tuple(int(v) for v in args.micro_batches.split(","))
    except ValueError:
        micro_batches = ()
    if not micro_batches or min(micro_batches) < 1 or list(micro_batches) != sorted(set(micro_batches)):
        raise SystemExit(f"calibrate_cpu: --micro-batches {args.micro_batches!r} must be increasing positive "
                         "integers, e.g. 1,2,4")
    if args.write and micro_batches != STAGE_MICRO_BATCHES:
        raise SystemExit("calibrate_cpu: --write takes the default --micro-batches (the catalog's stage fit)")
    size = dataclasses.replace(hm.FULL, repeats=args.repeats, micro_batches=micro_batches)
    cores, devices = hm.host_cores(), len(jax.devices())
    load = os.getloadavg()[0]
    print(f"{devices} {jax.devices()[0].platform} devices on {cores} cores; host load average {load:.1f}")
    points = hm.gemm_points(size)
    for (m, n, k), r in points:
        print(f"GEMM float32 ({m}, {n}, {k}): {r / 1e9:.1f} GFLOP per CPU second (measured)")
    rate, half = hm.fit_gemm(points)
    worst = max(abs(np.log(r / (rate * np.prod([d / (d + half) for d in s])))) for s, r in points)
    print(f"GEMM fit: {rate / 1e9:.1f} GFLOP per CPU second at large shapes, half dimension {half:.1f} "
          f"(fitted; worst point off by {np.expm1(worst):.0%})")
    mem = hm.memory_rate(args.repeats)
    print(f"elementwise x*a+b, 1 and 4 MiB per device, all devices: {mem / 1e9:.2f} GB per CPU second (measured)")
    stage = hm.stage_points(size, cores)
    for mb, t in stage:
        print(f"Llama-2 small middle stage of 1 layer, forward + backward, {mb} sequences, {cores} at once: "
              f"{t * 1e3:.2f} ms CPU each (measured)")
    soft = hm.softmax_rate(args.repeats)
    print(f"softmax float32 over [16 and 64, 128, 128]: {soft / 1e9:.2f} GB per CPU second (4 passes; measured)")
    mem, cache, spilled = hm.fit_stage(stage, (rate, half), soft, size)
    print(f"stage fit: other elementwise work {mem / 1e9:.2f} GB per CPU second while a stage's activations "
          f"fit {cache / 2 ** 20:.1f} MiB, {spilled / 1e9:.2f} beyond (fitted)")
    ar = hm.all_reduce_points(size, cores)
    for n, b, s in ar:
        print(f"all-reduce {b / 2 ** 20:.3g} MiB over {n}: {s * 1e3:.3f} ms per device, all busy (measured)")
    lat, link = hm.fit_link(ar)
    print(f"all-reduce fit: latency {lat * 1e6:.0f} us, {link / 1e9:.2f} GB/s per device, all busy (fitted)")
    try:
        figures = dataclasses.asdict(hm.calibration(cores=cores, devices=devices, rate=rate, half=half, mem=mem,
                                                    cache=cache, spilled=spilled, soft=soft, link=link, lat=lat))
        print("catalog values: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    except ValueError as e:
        # a stage time below what its GEMMs and softmax alone take leaves no time (or less) for the rest, and a
        # collective's fixed cost below the noise of few repeats fits to 0. Only a catalog entry needs them
        # positive.
        msg = f"calibrate_cpu: {e} for the catalog; nothing written (measure again on a quieter host, or with " \
              "more --repeats)"
        if args.write or "nan" in str(e) or "inf" in str(e):    # NaN or Inf: an error anyway
            raise SystemExit(msg)
        print(msg.replace("; nothing written", "; --write would refuse them"), file=sys.stderr)
        return
    if args.write:
        note = (f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
                f"{_cpu_name()} ({cores} cores, {devices} devices), host load average {load:.1f}, "
                f"`python benchmarks/calibrate_cpu.py --repeats {args.repeats} --write`.")
        write(OUT, figures, textwrap.fill(note, 116))
        print(f"written to {os.path.relpath(OUT)}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "an unnamed CPU"


if __name__ == "__main__":
    main()
