"""Collective communication times: the one model every cost estimate in cfp uses.

An alpha-beta model per algorithm. With n devices, B the per-device bytes of the (larger) buffer, `bw` the
per-direction bandwidth of the slowest link in the group and `lat` its per-step latency:

  ring  all-reduce            2(n-1)·lat + 2(n-1)/n · B/bw     (reduce-scatter then all-gather)
  ring  all-gather / reduce-scatter / all-to-all   (n-1)·lat + (n-1)/n · B/bw
  tree  all-reduce            2·ceil(log2 n)·lat + 2 · B/bw    (pipelined reduce up, broadcast down)
  collective-permute          lat + B/bw

plus a fixed launch latency per collective. Latencies are NCCL's own tuning constants (NVIDIA/nccl,
src/graph/tuning.cc: base latency 8.4 us for ring/Simple; per-hop `hwLat` Simple protocol: ring 5.7 us over
NVLink and PCIe, 6.6 us over the network; tree 28 us, 50 us over the network). Bandwidths per link are in
`LINKS` with their sources.
"""
from __future__ import annotations

import dataclasses
import enum
import math

from cfp.errors import ConfigError


class Algorithm(str, enum.Enum):
    RING = "ring"
    TREE = "tree"


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of connection: per-direction bandwidth (GB/s) and per-step latencies (us) by algorithm."""

    name: str
    gbps: float
    ring_latency_us: float
    tree_latency_us: float
    source: str

    def __post_init__(self):
        if not (self.gbps > 0 and self.ring_latency_us >= 0 and self.tree_latency_us >= 0):
            raise ConfigError(f"link {self.name!r}: bandwidth must be positive and latencies non-negative")


BASE_LATENCY_US = 8.4


def _cpu_link_gbps() -> float:
    """Per-device all-reduce bandwidth of this machine's XLA:CPU devices, all busy (`cpu_calibration`)."""
    from cfp.hardware.cpu_calibration import CPU
    return CPU.link_gbps_per_core * CPU.cores / CPU.devices


# Per-direction bandwidths: NVLink 3 = 600 GB/s total per A100 [A100 datasheet]; NVLink 4 = 900 GB/s total per
# H100 [H100 datasheet]; NVLink 2 = 300 GB/s total per V100 [V100 datasheet]; PCIe Gen4 x16 = 32 GB/s and Gen5
# = 64 GB/s per direction [PCI-SIG]; InfiniBand HDR 200 Gb/s and NDR 400 Gb/s per port, one port per GPU
# [NVIDIA ConnectX-6/-7 datasheets]; 25 GbE TCP (the HexiScale/FlashFlex clusters) 3.125 GB/s.
LINKS: dict[str, Link] = {k.name: k for k in (
    Link("NVLink 2", 150.0, 5.7, 28.0, "V100 datasheet"),
    Link("NVLink 3", 300.0, 5.7, 28.0, "A100 datasheet"),
    Link("NVLink 4", 450.0, 5.7, 28.0, "H100 datasheet"),
    Link("PCIe Gen4 x16", 32.0, 5.7, 28.0, "PCI-SIG PCIe 4.0"),
    Link("PCIe Gen5 x16", 64.0, 5.7, 28.0, "PCI-SIG PCIe 5.0"),
    Link("InfiniBand HDR", 25.0, 6.6, 50.0, "ConnectX-6 datasheet"),
    Link("InfiniBand NDR", 50.0, 6.6, 50.0, "ConnectX-7 datasheet"),
    Link("25GbE", 3.125, 6.6, 50.0, "IEEE 802.3by"),
    Link("shared host memory", _cpu_link_gbps(), 0.0, 0.0, "cpu catalog entry (benchmarks/calibrate_cpu.py)"),
)}


def get_link(name: str) -> Link:
    if name not in LINKS:
        raise ConfigError(f"unknown link {name!r}; known: {', '.join(LINKS)}")
    return LINKS[name]


def collective_time(kind: str, nbytes: float, n: int, link_bytes_per_s: float, latency_s: float = 0.0,
                    algorithm: Algorithm = Algorithm.RING) -> float:
    """Seconds of one collective of `kind` ("all-reduce", "all-gather", ...) over `n` devices.

    `latency_s` is the per-step latency (0: bandwidth only, as the in-graph estimates of tiny test programs use
    on hosts without a link table); the fixed launch latency comes with it (BASE_LATENCY_US when it is > 0).
    """
    if n <= 1:
        return 0.0
    algorithm = Algorithm(algorithm)
    base = BASE_LATENCY_US * 1e-6 if latency_s > 0 else 0.0
    if kind == "all-reduce":
        if algorithm is Algorithm.TREE:
            return base + 2 * math.ceil(math.log2(n)) * latency_s + 2 * nbytes / link_bytes_per_s
        return base + 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / link_bytes_per_s
    if kind == "collective-permute":
        return base + latency_s + nbytes / link_bytes_per_s
    return base + (n - 1) * latency_s + (n - 1) / n * nbytes / link_bytes_per_s


def link_collective_time(kind: str, nbytes: float, n: int, link: Link | str,
                         algorithm: Algorithm | None = None) -> float:
    """`collective_time` over a catalog link; all-reduce picks the faster of ring and tree unless told."""
    link = get_link(link) if isinstance(link, str) else link
    bw = link.gbps * 1e9
    if kind == "all-reduce" and algorithm is None:
        return min(link_collective_time(kind, nbytes, n, link, a) for a in Algorithm)
    algorithm = Algorithm(algorithm or Algorithm.RING)
    lat = (link.tree_latency_us if algorithm is Algorithm.TREE else link.ring_latency_us) * 1e-6
    return collective_time(kind, nbytes, n, bw, lat, algorithm)
