"""Alpha-beta models of collectives: what one collective of B bytes over n devices costs, latency included.

  all-gather, reduce-scatter, all-to-all   t = alpha(n) + (n-1)/n · B / bw
  all-reduce                               t = alpha(n) + 2(n-1)/n · B / bw
  collective-permute                       t = alpha(n) + B / bw

with B the per-device bytes of the larger buffer and alpha(n) = a0 + a1·(n-1) the latency of one collective.

On XLA:CPU devices (`fit_host`) each kind's (a0, a1, bw) is fitted by least squares to collectives measured
on this host (several sizes, two group sizes), each measured minus the same program without the collective
(so a jitted call's dispatch is not counted as latency). The fit is cached as JSON under a host key (CPU
model, usable cores, jax version, device count), so a host measures once. On GPUs (`for_gpu`) the figures are
the catalog's (`cfp.hardware.collectives`): each link's bandwidth and NCCL's published latencies (NVIDIA/nccl
src/graph/tuning.cc, see that module). The search prices its segment transitions and resharding with it, so
many small reshards cost what their latencies add up to, not only their bytes.

Self-contained on purpose: a host calibration can call `fit_host` / `host_model` and read the fitted figures.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import time
from typing import Callable, Mapping

import numpy as np

KINDS = ("all-gather", "all-to-all", "all-reduce")
# the kinds a measured kind stands for (a reduce-scatter moves what an all-gather does; a permute one buffer)
_ALIAS = {"reduce-scatter": "all-gather", "collective-permute": "all-to-all"}
SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)     # per-device bytes of the measured collectives
FIT_VERSION = 1
MIN_SECONDS = 1e-6       # a measured collective is never taken as cheaper than this
WEIGHT_FLOOR = 10e-6     # the fit weighs each point by 1/(seconds + this): relative, but not ruled by tiny ones


def wire_factor(kind: str, n: int) -> float:
    """Bytes on the wire per byte of the larger per-device buffer, by the ring algorithm."""
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind == "collective-permute":
        return 1.0
    return (n - 1) / n


@dataclasses.dataclass(frozen=True)
class KindFit:
    """One collective kind: latency a0 + a1·(n-1) seconds, `bandwidth` bytes/s on the wire."""

    a0: float
    a1: float
    bandwidth: float

    def time(self, kind: str, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        return self.a0 + self.a1 * (n - 1) + wire_factor(kind, n) * nbytes / self.bandwidth


@dataclasses.dataclass(frozen=True)
class AlphaBetaModel:
    """Per-kind alpha-beta figures and where they come from (`source`: measured on a host, or a catalog link)."""

    fits: Mapping[str, KindFit]
    source: str
    points: tuple = ()      # (kind, group size, bytes, measured seconds) the fit was made from

    def time(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds of one collective of `kind` over `n` devices with `nbytes` per-device bytes."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        fit = self.fits.get(kind) or self.fits[_ALIAS.get(kind, "all-gather")]
        return fit.time(kind, nbytes, n)

    @property
    def latency(self) -> float:
        """Seconds of the smallest collective, all-gather over 2 devices (the alpha of Alpa's alpha-beta)."""
        g = self.fits["all-gather"]
        return g.a0 + g.a1

    @property
    def bandwidth(self) -> float:
        return self.fits["all-gather"].bandwidth

    def with_bandwidth(self, bytes_per_s: float) -> "AlphaBetaModel":
        """The same latencies with every kind's bandwidth set to `bytes_per_s` (a link the user gave)."""
        fits = {k: dataclasses.replace(f, bandwidth=bytes_per_s) for k, f in self.fits.items()}
        return dataclasses.replace(self, fits=fits, source=f"{self.source}, bandwidth {bytes_per_s / 1e9:.3g} GB/s given")

    def to_json(self) -> str:
        return json.dumps({"version": FIT_VERSION, "source": self.source, "points": [list(p) for p in self.points],
                           "fits": {k: dataclasses.asdict(f) for k, f in self.fits.items()}}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "AlphaBetaModel":
        d = json.loads(text)
        if d.get("version") != FIT_VERSION:
            raise ValueError(f"alpha-beta fit version {d.get('version')!r}, expected {FIT_VERSION}")
        fits = {k: KindFit(float(f["a0"]), float(f["a1"]), float(f["bandwidth"])) for k, f in d["fits"].items()}
        if set(fits) != set(KINDS) or not all(f.bandwidth > 0 and f.a0 >= 0 and f.a1 >= 0 for f in fits.values()):
            raise ValueError("alpha-beta fit: every kind needs a0, a1 >= 0 and a positive bandwidth")
        return cls(fits, str(d["source"]), tuple(tuple(p) for p in d.get("points", ())))


def for_gpu(gpu) -> AlphaBetaModel:
    """A catalog GPU's model: its link's bandwidth and ring latencies with NCCL's launch latency (the figures
    and sources of `cfp.hardware.collectives`)."""
    from cfp.hardware.collectives import BASE_LATENCY_US, LINKS
    link = LINKS.get(gpu.link)
    lat = (link.ring_latency_us if link else 0.0) * 1e-6
    base = BASE_LATENCY_US * 1e-6 if lat > 0 else 0.0
    fit = KindFit(base, lat, gpu.link_gbps * 1e9)
    src = f"{gpu.name} over {gpu.link}" + (f" ({link.source}; latencies NVIDIA/nccl src/graph/tuning.cc)" if link else "")
    # ring all-reduce takes 2(n-1) latency steps, the others n-1
    return AlphaBetaModel({"all-gather": fit, "all-to-all": fit, "all-reduce": KindFit(base, 2 * lat, fit.bandwidth)},
                          src)


def host_key() -> str:
    """What the host's fit depends on: CPU model, usable cores, jax version, device count and platform."""
    import jax
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu} | {cores} cores | jax {jax.__version__} | {jax.device_count()} {jax.devices()[0].platform} devices"


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cfp", "alpha_beta")


def host_model(cache_dir: str | None = None, log: Callable[[str], None] = lambda *_: None) -> AlphaBetaModel:
    """This host's fitted model: read from the cache under `host_key()`, else measured (`fit_host`) and cached."""
    key = host_key()
    path = os.path.join(cache_dir or default_cache_dir(), hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
    try:
        with open(path) as f:
            return AlphaBetaModel.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        pass
    t0 = time.perf_counter()
    model = fit_host(key)
    log(f"alpha-beta fit of this host's collectives measured in {time.perf_counter() - t0:.1f} s: "
        f"{summary(model)}")
    try:
        from cfp.files import write_text_atomic
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text_atomic(path, model.to_json())
    except OSError:
        pass      # an unwritable cache measures again next time; the fit itself is good
    return model


def summary(model: AlphaBetaModel) -> str:
    return "; ".join(f"{k} {f.a0 * 1e6:.1f}+{f.a1 * 1e6:.1f}(n-1) us, {f.bandwidth / 1e9:.2f} GB/s"
                     for k, f in model.fits.items()) + f" ({model.source})"


def _programs(kind: str, group: int, nbytes: int, devices):
    """(collective program, the same program without the collective, its argument) over groups of `group`."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    n = len(devices)
    mesh = Mesh(np.array(devices).reshape(n // group, group), ("r", "g"))
    m = max(nbytes // 4 // group, 1)
    if kind == "all-gather":      # per device: m·group floats gathered
        x, src, dst = np.zeros((n // group, group * m), np.float32), P("r", "g"), P("r", None)
        fn = lambda v: v + 0
    elif kind == "all-to-all":    # per device: a (group, m) buffer, dim 1 sharded -> dim 2 sharded
        x = np.zeros((n // group, group, group * m), np.float32)
        src, dst = P("r", "g", None), P("r", None, "g")
        fn = lambda v: v + 0
    else:                         # all-reduce of m·group floats per device
        m = max(nbytes // 4, 1)
        x, src, dst = np.zeros((n // group, group, m), np.float32), P("r", "g", None), P("r", None)
        fn = lambda v: v.sum(1)
    xs = jax.device_put(x, NamedSharding(mesh, src))
    coll = jax.jit(fn, out_shardings=NamedSharding(mesh, dst)).lower(xs).compile()
    # without the collective: each device reads and writes its own buffer once, as the collective's program does
    loc = jax.jit(lambda v: v + 0, out_shardings=NamedSharding(mesh, src)).lower(xs).compile()
    return coll, loc, xs


def measure(kind: str, group: int, nbytes: int, rounds: int = 25) -> tuple[float, float]:
    """(seconds of one collective of `kind` over groups of `group` devices, relative spread): the median over
    `rounds` of the program with it minus the same program without, run back to back (so a burst of the other
    users' load lands on both)."""
    import jax
    coll, loc, x = _programs(kind, group, nbytes, jax.devices())
    for f in (coll, loc, coll, loc):
        jax.block_until_ready(f(x))
    diffs = []
    for r in range(rounds):
        t = {}
        for f in ((coll, loc) if r % 2 else (loc, coll)):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            t[f] = time.perf_counter() - t0
        diffs.append(t[coll] - t[loc])
    q1, med, q3 = statistics.quantiles(diffs, n=4)
    t = max(med, MIN_SECONDS)
    return t, (q3 - q1) / 2 / t


def fit_points(points) -> dict[str, KindFit]:
    """Least-squares (a0, a1, 1/bw) per kind from (kind, group, bytes, seconds) points, no term negative
    (a negative one is dropped and the rest refitted)."""
    fits = {}
    for kind in KINDS:
        rows = [(n, b, t) for k, n, b, t in points if k == kind]
        cols = [0, 1, 2]
        while True:
            a = np.array([[1.0, n - 1.0, wire_factor(kind, n) * b][c] for n, b, _ in rows for c in cols],
                         float).reshape(len(rows), len(cols))
            # near-relative least squares: small collectives count about as much as large ones
            t = np.array([r[2] for r in rows])
            w = 1.0 / (t + WEIGHT_FLOOR)
            coef = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)[0]
            if (coef >= 0).all() or len(cols) == 1:
                break
            # a negative latency term goes first; a negative bandwidth term (larger collectives measured faster:
            # noise on a loaded host) is dropped once it is the only one, leaving a latency-only fit. Keeping it
            # while nothing else was dropped looped forever (make demo hung at a host load of ~14)
            neg = [c for c, v in zip(cols, coef) if v < 0]
            drop = [c for c in neg if c != 2] or neg
            cols = [c for c in cols if c not in drop]
        full = dict(zip(cols, coef))
        beta = max(full.get(2, 0.0), 1e-15)
        fits[kind] = KindFit(max(full.get(0, 0.0), 0.0), max(full.get(1, 0.0), 0.0), 1.0 / beta)
    return fits


def fit_host(key: str | None = None, sizes=SIZES, rounds: int = 25) -> AlphaBetaModel:
    """Measure every kind at `sizes` over groups of 2 and of all devices, and fit (see the module doc)."""
    import jax
    n = jax.device_count()
    groups = sorted({g for g in (2, n) if g > 1 and n % g == 0})
    if not groups:
        raise ValueError(f"an alpha-beta fit needs at least 2 devices, this host has {n}")
    points = tuple((kind, g, b, measure(kind, g, b, rounds)[0]) for kind in KINDS for g in groups for b in sizes)
    return AlphaBetaModel(fit_points(points), f"measured on {key or host_key()}", points)
