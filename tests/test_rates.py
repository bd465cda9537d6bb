"""The rate model (cfp.hardware.rates) and the collective model (ring vs tree, latency)."""
import math

import pytest

from cfp.errors import ConfigError
from cfp.hardware import rates
from cfp.hardware.collectives import (BASE_LATENCY_US, Algorithm, collective_time, get_link,
                                      link_collective_time)
from cfp.hardware.gpus import GPUS, Precision, get_gpu


@pytest.mark.parametrize("dtype,mp,gpu,want", [
    ("float32", None, "A100-PCIe-40G", Precision.TF32),        # JAX default on Ampere: TF32 tensor cores
    ("float32", "highest", "A100-PCIe-40G", Precision.FP32),
    ("float32", "float32", "H100-SXM", Precision.FP32),
    ("float32", "bfloat16", "H100-SXM", Precision.BF16),
    ("bfloat16", None, "A100-SXM-80G", Precision.BF16),
    ("float16", "highest", "V100-SXM2-32G", Precision.FP16),
    ("bfloat16", None, "V100-SXM2-32G", Precision.FP32),       # no BF16 tensor cores on Volta
    ("float32", None, "V100-SXM2-32G", Precision.FP32),        # nor TF32
    ("float8_e4m3fn", None, "H100-SXM", Precision.FP8),
    ("float8_e4m3fn", None, "A100-SXM-80G", Precision.FP16),   # no FP8 on Ampere: 16-bit tensor cores
    ("float32", None, "cpu", Precision.FP32),
])
def test_dot_precision(dtype, mp, gpu, want):
    assert rates.dot_precision(dtype, mp, get_gpu(gpu)) is want


def test_float32_on_a100_runs_at_tf32_rate_not_fp32():
    a100 = get_gpu("A100-PCIe-40G")
    tf32 = rates.achievable_flops(a100, rates.dot_precision("float32", None, a100))
    fp32 = rates.achievable_flops(a100, Precision.FP32)
    assert tf32 / fp32 == pytest.approx(156 / 19.5 * rates.GEMM_EFFICIENCY[Precision.TF32]
                                        / rates.GEMM_EFFICIENCY[Precision.FP32])


def test_gemm_efficiency_grows_with_shape_and_stays_below_peak():
    big = rates.gemm_efficiency(Precision.BF16, 8192, 8192, 8192)
    small = rates.gemm_efficiency(Precision.BF16, 64, 8192, 8192)
    assert small < big < rates.GEMM_EFFICIENCY[Precision.BF16] <= 1.0
    # a dimension equal to HALF_DIM halves that dimension's factor
    assert small / big == pytest.approx(0.5 / (8192 / (8192 + rates.HALF_DIM)))


def test_dot_time_is_flops_over_rate():
    g = get_gpu("H100-SXM")
    t = rates.dot_time(1e12, g, "bfloat16", None, (4096, 4096, 4096))
    assert t == pytest.approx(1e12 / (989e12 * rates.gemm_efficiency(Precision.BF16, 4096, 4096, 4096)))
    assert rates.memory_time(3.35e9, g) == pytest.approx(1e-3)


@pytest.mark.parametrize("bad", [("int8", None), ("float32", "fast")])
def test_bad_dtype_or_precision_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=repr(bad[0]) if bad[0] == "int8" else "fast"):
        rates.dot_precision(*bad, get_gpu("A100-SXM-80G"))


def test_unknown_gpu_names_the_known_ones():
    with pytest.raises(ConfigError, match="unknown gpu 'A1000'.*A100-SXM-80G"):
        get_gpu("A1000")


def test_every_catalog_link_is_known():
    for g in GPUS.values():
        assert get_link(g.link).name == g.link


def test_ring_latency_and_bandwidth_terms():
    lat, bw, n, b = 5e-6, 1e10, 8, 1e8
    ring = collective_time("all-reduce", b, n, bw, lat, Algorithm.RING)
    assert ring == pytest.approx(BASE_LATENCY_US * 1e-6 + 2 * (n - 1) * lat + 2 * (n - 1) / n * b / bw)
    ag = collective_time("all-gather", b, n, bw, lat)
    assert ag == pytest.approx(BASE_LATENCY_US * 1e-6 + (n - 1) * lat + (n - 1) / n * b / bw)
    assert collective_time("all-reduce", b, 1, bw, lat) == 0.0


def test_tree_beats_ring_only_for_small_messages_on_many_devices():
    link = get_link("InfiniBand HDR")
    n = 1024
    small_ring = link_collective_time("all-reduce", 1e3, n, link, Algorithm.RING)
    small_tree = link_collective_time("all-reduce", 1e3, n, link, Algorithm.TREE)
    assert small_tree < small_ring
    assert small_tree == pytest.approx(BASE_LATENCY_US * 1e-6 + 2 * math.ceil(math.log2(n)) * 50e-6
                                       + 2 * 1e3 / 25e9)
    # on 8 devices ring moves 2·7/8 of the bytes against tree's 2: ring wins for big messages
    big_ring = link_collective_time("all-reduce", 1e10, 8, link, Algorithm.RING)
    big_tree = link_collective_time("all-reduce", 1e10, 8, link, Algorithm.TREE)
    assert big_ring < big_tree
    assert link_collective_time("all-reduce", 1e3, n, link) == small_tree     # picks the faster
    assert link_collective_time("all-reduce", 1e10, 8, link) == big_ring


def test_slower_link_is_slower():
    t = {name: link_collective_time("all-gather", 1e8, 8, name) for name in ("NVLink 3", "PCIe Gen4 x16", "25GbE")}
    assert t["NVLink 3"] < t["PCIe Gen4 x16"] < t["25GbE"]
    with pytest.raises(ConfigError, match="unknown link 'NVLink 9'"):
        get_link("NVLink 9")


def test_a_measured_entry_brings_its_own_gemm_curve():
    """The `cpu` entry (fitted by benchmarks/calibrate_cpu.py) prices GEMMs by its own curve, not the datasheet
    GPUs' (large-GEMM fraction 0.9 in FP32, half dimension 64)."""
    import dataclasses
    cpu = get_gpu("cpu")
    large, half = cpu.gemm_curve
    assert rates.gemm_efficiency(Precision.FP32, 256, 128, 32, cpu) == pytest.approx(
        large * 256 / (256 + half) * 128 / (128 + half) * 32 / (32 + half))
    assert rates.achievable_flops(cpu, Precision.FP32, 256, 128, 32) == pytest.approx(
        cpu.peak(Precision.FP32) * rates.gemm_efficiency(Precision.FP32, 256, 128, 32, cpu))
    assert rates.gemm_efficiency(Precision.FP32, 256, 128, 32) != pytest.approx(
        rates.gemm_efficiency(Precision.FP32, 256, 128, 32, cpu))
    with pytest.raises(ConfigError, match="gemm_curve"):
        dataclasses.replace(cpu, gemm_curve=(1.5, 10.0))
    with pytest.raises(ConfigError, match="softmax_gbps"):
        dataclasses.replace(cpu, softmax_gbps=0.0)
