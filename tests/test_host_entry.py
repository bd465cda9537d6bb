"""This host's measured `cpu` entry (issue 40 item 2): measured on first use, cached under a key of the host (CPU
model, cores this process may use, jax version) in the user cache dir, reused after, measured again on
`--recalibrate`; the catalog's entry the named fallback. The measurement here is a stand-in that counts its calls
and returns figures unlike the catalog's (the real one takes ~40 s of CPU: `test_quick_sizes_run_the_real_kernels`
runs its kernels at the tiny size), so a reuse, a re-measure and which figures priced a plan are all visible."""
from __future__ import annotations

import dataclasses
import json

import pytest

from cfp.hardware import host_entry, host_measure
from cfp.hardware.cpu_calibration import CPU
from cfp.planner.cluster import parse_cluster

MEASURED = dataclasses.replace(CPU, gemm_gflops_per_core=2 * CPU.gemm_gflops_per_core, mem_gbps_per_core=3.0)


class Counting:
    """A measurement that returns `MEASURED` and counts its calls (or raises `error`)."""

    def __init__(self, error: Exception | None = None):
        self.calls, self.error = 0, error

    def __call__(self, size, log):
        self.calls += 1
        if self.error is not None:
            raise self.error
        log("measured (stand-in)")
        return MEASURED


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(host_entry.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(host_entry.DISABLE_ENV, "1")
    return tmp_path / "cache"


def test_the_cache_key_changes_with_each_component(cache, monkeypatch):
    """CPU model, the cores the process may use (its affinity, not the host's count) and the jax version each
    change the key and the cache file."""
    import jax
    base = host_entry.host_key()
    assert base == {"cpu": host_entry.cpu_model(), "cores": host_measure.host_cores(), "jax": jax.__version__}
    paths = {host_entry.cache_path(base)}
    monkeypatch.setattr(host_entry, "cpu_model", lambda: "Another CPU 9000")
    paths.add(host_entry.cache_path(host_entry.host_key()))
    monkeypatch.undo()
    monkeypatch.setenv(host_entry.CACHE_ENV, str(cache))
    monkeypatch.setattr(host_measure.os, "sched_getaffinity", lambda pid: {0})
    assert host_entry.host_key()["cores"] == 1
    paths.add(host_entry.cache_path(host_entry.host_key()))
    monkeypatch.undo()
    monkeypatch.setenv(host_entry.CACHE_ENV, str(cache))
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    paths.add(host_entry.cache_path(host_entry.host_key()))
    assert len(paths) == 4 and all(p.parent == cache for p in paths)


def test_first_use_measures_then_reuses_and_recalibrate_measures_again(cache):
    fake, said = Counting(), []
    first = host_entry.host_figures(measure_fn=fake, log=said.append)
    assert fake.calls == 1 and first.measured and first.calibration == MEASURED
    assert any("measuring this host's devices" in s for s in said)      # said, never silent
    stored = json.loads(host_entry.cache_path(host_entry.host_key()).read_text())
    assert stored["key"] == host_entry.host_key() and stored["calibration"]["mem_gbps_per_core"] == 3.0
    again = host_entry.host_figures(measure_fn=fake)
    assert fake.calls == 1 and again.calibration == MEASURED and again.date == first.date
    host_entry.host_figures(recalibrate=True, measure_fn=fake)
    assert fake.calls == 2
    # another host's key: its own measurement, this one's file untouched
    other = dict(host_entry.host_key(), cores=host_entry.host_key()["cores"] + 1)
    assert host_entry._read(host_entry.cache_path(host_entry.host_key()), other) is None


def test_the_fallback_is_the_catalog_entry_named(cache, monkeypatch):
    failing = Counting(ValueError("fitted mem_gbps_per_core=-0.1 must be positive"))
    got = host_entry.host_figures(measure_fn=failing)
    assert not got.measured and got.calibration == CPU
    assert "catalog cpu entry" in got.describe() and "measurement failed" in got.describe()
    assert not host_entry.cache_path(host_entry.host_key()).exists()
    monkeypatch.setenv(host_entry.DISABLE_ENV, "0")
    off = Counting()
    got = host_entry.host_figures(measure_fn=off)
    assert off.calls == 0 and got.calibration == CPU and "CFP_CALIBRATE=0" in got.describe()


def test_cfp_plan_prices_with_the_measured_entry_and_says_so(cache, monkeypatch, tmp_path, capsys):
    """`cfp plan` on a cluster of cpu devices: the first run measures (said on stderr), a second reuses, and
    each estimate printed names the figures; --recalibrate measures again; the measured figures price it
    (faster GEMMs than the catalog's: a shorter estimated step)."""
    from cfp.cli.main import main
    fake = Counting()
    monkeypatch.setattr(host_entry, "measure", fake)
    cluster = tmp_path / "local.yaml"
    cluster.write_text("inter_machine_bandwidth: 1.75GB/s\nmachines:\n  - {gpu: cpu, count: 8, "
                       "intra_bandwidth: 1.75GB/s}\n")
    argv = ["plan", "--cluster", str(cluster), "--model", "gpt", "--config", "tiny", "--global-batch-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert fake.calls == 1 and "measuring this host's devices" in out.err
    assert "figures: cpu devices: measured host entry" in out.out and "just now" in out.out
    assert main(argv) == 0
    out = capsys.readouterr()
    assert fake.calls == 1 and "measured host entry" in out.out and "just now" not in out.out
    assert main(argv + ["--recalibrate"]) == 0
    assert fake.calls == 2
    capsys.readouterr()
    monkeypatch.setenv(host_entry.DISABLE_ENV, "0")
    assert main(argv) == 0
    assert "figures: cpu devices: catalog cpu entry" in capsys.readouterr().out


def test_the_measured_figures_price_the_plan(cache):
    """A cluster's cpu machines take the measured entry (its GEMM rate here twice the catalog's), the others
    keep their published figures."""
    cl = parse_cluster({"inter_machine_bandwidth": "1GB/s", "machines": [
        {"gpu": "cpu", "count": 8, "intra_bandwidth": "2GB/s"},
        {"gpu": "A100-SXM-80G", "count": 8, "intra_bandwidth": "300GB/s"}]})
    fig = host_entry.host_figures(measure_fn=Counting())
    got = cl.with_device(fig.spec)
    assert got.machines[0].gpu.peaks == {k: 2 * v for k, v in cl.machines[0].gpu.peaks.items()}
    assert got.machines[1] == cl.machines[1] and got.machines[0].memory == cl.machines[0].memory


def test_plan_recalibrate_without_cpu_devices_is_one_line(tmp_path, capsys):
    from cfp.cli.main import main
    cluster = tmp_path / "gpus.yaml"
    cluster.write_text("inter_machine_bandwidth: 10GB/s\nmachines:\n  - {gpu: A100-SXM-80G, count: 8, "
                       "intra_bandwidth: 300GB/s}\n")
    assert main(["plan", "--cluster", str(cluster), "--model", "gpt", "--config", "tiny", "--recalibrate"]) != 0
    err = capsys.readouterr().err
    assert "--recalibrate" in err and "Traceback" not in err


def test_quick_sizes_run_the_real_kernels():
    """The measurement's kernels at the tiny size give positive GEMM, softmax and collective figures (the
    stage fit, whose compiles take the time, is the benchmark's: benchmarks/calibrate_cpu.py, run shrunk by
    tests/test_scripts.py)."""
    size = host_measure.TINY
    rate, half = host_measure.fit_gemm(host_measure.gemm_points(size))
    assert rate > 0 and half >= 0
    assert host_measure.softmax_rate(1) > 0
    points = host_measure.all_reduce_points(size, host_measure.host_cores())
    assert len(points) == 2 and all(s >= 0 for *_, s in points)
    assert set(host_measure.SIZES) == {"full", "quick", "tiny"}
    with pytest.raises(ValueError, match="micro-batches|two micro-batches"):
        dataclasses.replace(size, micro_batches=(1,))
