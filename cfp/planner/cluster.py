"""The cluster a layout is planned for: machines of catalog devices and the links between them.

`parse_cluster` turns the cluster file's mapping (already loaded from YAML at the CLI) into a typed,
immutable `Cluster`; every bad value is a one-line `ConfigError` naming it. Devices are numbered
machine-major (machine 0's devices first), which is the numbering `devices_id` of a layout uses.
"""
from __future__ import annotations

import dataclasses

import functools
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from cfp.errors import ConfigError
from cfp.hardware.gpus import GpuSpec, get_gpu

# decimal prefixes (datasheets quote GB/s and GB decimally); binary ones for memory as well
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0 ** 10, "mi": 2.0 ** 20,
           "gi": 2.0 ** 30, "ti": 2.0 ** 40}
_BW = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]i?)?\s*(B|b)\s*(?:/s|ps)\s*$")
_MEM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]i?)?\s*B\s*$")


def parse_bandwidth(text: Any, what: str) -> float:
    """"25GB/s", "100Gb/s", "1.25 GB/s" -> bytes per second (b = bits)."""
    m = _BW.match(str(text)) if isinstance(text, str) else None
    if not m:
        raise ConfigError(f"{what}={text!r} is not a bandwidth; write e.g. 25GB/s, 100Gb/s or 800MB/s")
    value = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()] / (8.0 if m.group(3) == "b" else 1.0)
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{what}={text!r} must be a positive, finite bandwidth")
    return value


def parse_memory(text: Any, what: str) -> float:
    """"24GB", "80 GiB" -> bytes."""
    m = _MEM.match(str(text)) if isinstance(text, str) else None
    if not m:
        raise ConfigError(f"{what}={text!r} is not a memory size; write e.g. 24GB or 80GiB")
    value = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{what}={text!r} must be a positive, finite memory size")
    return value


@dataclass(frozen=True)
class Machine:
    """`count` identical devices of type `gpu` joined by `intra_bandwidth` (bytes/s per direction)."""
    gpu: GpuSpec
    count: int
    intra_bandwidth: float
    memory: float            # bytes per device

    def __post_init__(self):
        if isinstance(self.count, bool) or not isinstance(self.count, numbers.Integral) or self.count <= 0:
            raise ConfigError(f"count={self.count!r} must be a positive integer")


@dataclass(frozen=True)
class Device:
    id: int
    machine: int
    gpu: GpuSpec
    memory: float


@dataclass(frozen=True)
class Cluster:
    """Machines in file order (a `repeat` expanded); `inter_bandwidth` is per device between machines."""
    machines: tuple[Machine, ...]
    inter_bandwidth: float

    def __post_init__(self):
        if not self.machines:
            raise ConfigError("a cluster needs at least one machine")

    @functools.cached_property
    def devices(self) -> tuple[Device, ...]:
        out, nxt = [], 0
        for mi, m in enumerate(self.machines):
            out += [Device(nxt + i, mi, m.gpu, m.memory) for i in range(m.count)]
            nxt += m.count
        return tuple(out)

    def with_device(self, spec: GpuSpec) -> "Cluster":
        """The cluster with its machines of `spec`'s device type described by `spec` (this host's measured
        `cpu` entry, `cfp.hardware.host_entry`); their memory stays as the file gave it."""
        machines = tuple(dataclasses.replace(m, gpu=spec) if m.gpu.name == spec.name else m for m in self.machines)
        return Cluster(machines=machines, inter_bandwidth=self.inter_bandwidth)

    def has_device(self, name: str) -> bool:
        """Whether any machine's devices are of catalog type `name`."""
        return any(m.gpu.name == name for m in self.machines)

    @property
    def num_devices(self) -> int:
        return sum(m.count for m in self.machines)

    def machine_of(self) -> list[int]:
        return [d.machine for d in self.devices]

    def link(self, a: int, b: int) -> float:
        """Bandwidth between machines `a` and `b` (bytes/s): the machine's own links when a == b."""
        return self.machines[a].intra_bandwidth if a == b else self.inter_bandwidth

    def summary(self) -> str:
        parts, i = [], 0
        while i < len(self.machines):
            m, j = self.machines[i], i
            while j + 1 < len(self.machines) and self.machines[j + 1] == m:
                j += 1
            parts.append(f"{j - i + 1}x{m.count} {m.gpu.name}")
            i = j + 1
        return " + ".join(parts)

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "Cluster":
        """The cluster of a YAML cluster file (examples/clusters/); a one-line ConfigError for a file that cannot
        be read, is not YAML or holds a bad value."""
        import yaml
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"cannot read cluster file {os.fspath(path)!r}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"cluster file {os.fspath(path)!r} is not YAML: {str(e).splitlines()[0]}") from None
        return parse_cluster(data)

    def to_dict(self) -> dict:
        return {"inter_machine_bandwidth": f"{_giga(self.inter_bandwidth)}GB/s",
                "machines": [{"gpu": m.gpu.name, "count": m.count,
                              "intra_bandwidth": f"{_giga(m.intra_bandwidth)}GB/s",
                              "memory": f"{_giga(m.memory)}GB"} for m in self.machines]}


def _giga(value: float) -> str:
    """`value` in units of 1e9, short ("25") where that reads back the same, else every digit ("85.89934592")."""
    short = f"{value / 1e9:g}"
    return short if float(short) * 1e9 == value else repr(value / 1e9)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ConfigError(f"{what}={value!r} must be a positive integer")
    return int(value)


def _machine(entry: Any, i: int) -> tuple[Machine, int]:
    where = f"machines[{i}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}={entry!r} must be a mapping with gpu, count, intra_bandwidth")
    allowed = {"gpu", "count", "intra_bandwidth", "memory", "repeat"}
    extra = sorted(set(entry) - allowed)
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r}; valid keys: {', '.join(sorted(allowed))}")
    for key in ("gpu", "count", "intra_bandwidth"):
        if key not in entry:
            raise ConfigError(f"{where}: missing required key {key!r}")
    gpu = get_gpu(entry["gpu"])
    count = _count(entry["count"], f"{where}.count")
    bw = parse_bandwidth(entry["intra_bandwidth"], f"{where}.intra_bandwidth")
    mem = parse_memory(entry["memory"], f"{where}.memory") if "memory" in entry else gpu.mem_gb * 1e9
    repeat = _count(entry.get("repeat", 1), f"{where}.repeat")
    return Machine(gpu, count, bw, mem), repeat


def as_cluster(value: Any) -> Cluster:
    """A `Cluster`, a cluster file's parsed mapping or its path, as a `Cluster`; anything else is a one-line
    ConfigError naming the accepted forms."""
    if isinstance(value, Cluster):
        return value
    if isinstance(value, Mapping):
        return parse_cluster(value)
    if isinstance(value, (str, os.PathLike)):
        return Cluster.load(value)
    raise ConfigError(f"cluster={value!r} must be a cfp.Cluster, a cluster file's path or its parsed mapping "
                      "(parse_cluster's)")


def parse_cluster(data: Any) -> Cluster:
    """The cluster file's mapping -> `Cluster` (see examples/clusters/ for the form)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a cluster file must be a mapping with inter_machine_bandwidth and machines, got "
                          f"{type(data).__name__}")
    extra = sorted(set(data) - {"inter_machine_bandwidth", "machines"})
    if extra:
        raise ConfigError(f"cluster: unknown key {extra[0]!r}; valid keys: inter_machine_bandwidth, machines")
    if "inter_machine_bandwidth" not in data:
        raise ConfigError("cluster: missing required key 'inter_machine_bandwidth'")
    inter = parse_bandwidth(data["inter_machine_bandwidth"], "inter_machine_bandwidth")
    entries = data.get("machines")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"machines={entries!r} must be a non-empty list of machines")
    machines = []
    for i, e in enumerate(entries):
        m, repeat = _machine(e, i)
        machines += [m] * repeat
    return Cluster(tuple(machines), inter)
