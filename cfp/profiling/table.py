"""Profile results: one `SegmentProfile` per unique segment kind, cached as versioned JSON.

The cache key (`cachekey.segment_cache_key`) hashes the segment's whole sub-program, its strategies' layouts,
the mesh, device kind, profiler settings and versions: a second run with the same inputs reads every segment
back and compiles nothing, and no other program's segment is ever read back.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from cfp.errors import ConfigError
from cfp.files import write_json_atomic
from cfp.profiling.options import ProfilerSpec

_log = logging.getLogger("cfp")

TABLE_VERSION = 3  # 2: segment memory excludes activations borrowed from other segments; 3: entry "combo" -> "choice"


@dataclasses.dataclass(frozen=True)
class ProfileEntry:
    """One strategy combination of a segment (one strategy index per block of the segment)."""

    choice: tuple[int, ...]
    time: float                 # seconds per run: measured median, or the cost model's estimate
    memory: int                 # per-device bytes: arguments + outputs + temporaries
    comm_bytes: int             # per-device bytes of all collectives in the compiled sub-program
    flops: float                # per-device FLOPs (XLA cost analysis)
    bytes_accessed: float       # per-device memory traffic (XLA cost analysis)
    collectives: tuple[tuple[str, int, int], ...]   # (kind, bytes, group size)
    measured: float | None = None   # measured median seconds (None under the estimate profiler)


@dataclasses.dataclass(frozen=True)
class SegmentProfile:
    kind: int
    fingerprint: str
    space: tuple[int, ...]          # strategies per block of the segment
    rule: str                       # how the profiled combinations were chosen
    entries: tuple[ProfileEntry, ...]

    def candidates(self, top_k: int) -> tuple[ProfileEntry, ...]:
        """The union of the `top_k` fastest and the `top_k` lowest-memory combinations (fastest first)."""
        fast = sorted(self.entries, key=lambda e: (e.time, e.memory))[:top_k]
        small = sorted(self.entries, key=lambda e: (e.memory, e.time))[:top_k]
        seen, out = set(), []
        for e in sorted(fast + small, key=lambda e: (e.time, e.memory)):
            if e.choice not in seen:
                seen.add(e.choice)
                out.append(e)
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SegmentProfile":
        validate_segment_dict(d)
        entries = tuple(ProfileEntry(tuple(e["choice"]), e["time"], e["memory"], e["comm_bytes"], e["flops"],
                                     e["bytes_accessed"], tuple(tuple(c) for c in e["collectives"]),
                                     e.get("measured")) for e in d["entries"])
        return cls(d["kind"], d["fingerprint"], tuple(d["space"]), d["rule"], entries)


@dataclasses.dataclass(frozen=True)
class ProfileTable:
    """Profiles of every unique segment kind of one program on one mesh."""

    mesh_shape: tuple[int, ...]
    device_kind: str
    jax_version: str
    profiler: ProfilerSpec
    segments: dict[int, SegmentProfile]   # by segment kind
    compiles: int = 0                 # compilations this table cost (0 when every segment came from the cache)
    profile_time: float = 0.0
    reused: tuple[int, ...] = ()      # segment kinds read from the profile cache

    def to_json(self, **kw) -> str:
        d = dataclasses.asdict(self)
        d["version"] = TABLE_VERSION
        d["profiler"] = str(self.profiler)
        d["segments"] = {str(k): v.to_dict() for k, v in self.segments.items()}
        return json.dumps(d, **kw)

    @classmethod
    def from_json(cls, text: str) -> "ProfileTable":
        """Parse a dumped table; bad content raises `ConfigError` naming the field (callers add the file)."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("version") != TABLE_VERSION:
            raise ConfigError(f"profile table version {d.get('version')!r} is not the supported {TABLE_VERSION}")
        return cls(tuple(d["mesh_shape"]), d["device_kind"], d["jax_version"], ProfilerSpec.parse(d["profiler"]),
                   {int(k): SegmentProfile.from_dict(v) for k, v in d["segments"].items()},
                   d.get("compiles", 0), d.get("profile_time", 0.0), tuple(d.get("reused", ())))


def _bad(field: str, what: str, value) -> None:
    raise ConfigError(f"field {field!r} must be {what}, got {value!r:.80}")


def _number(v, low: float = 0.0) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and low <= v < float("inf")


def validate_segment_dict(d) -> None:
    """Types and ranges of one segment's profile (finite, non-negative times and bytes); `ConfigError` naming
    the field otherwise."""
    if not isinstance(d, dict):
        raise ConfigError(f"a segment profile must be a JSON object, got {type(d).__name__}")
    for key in ("kind", "fingerprint", "space", "rule", "entries"):
        if key not in d:
            raise ConfigError(f"missing field {key!r}")
    space = d["space"]
    if not isinstance(space, list) or not all(isinstance(n, int) and n >= 1 for n in space):
        _bad("space", "a list of positive strategy counts", space)
    if not isinstance(d["entries"], list) or not d["entries"]:
        _bad("entries", "a non-empty list of profiled combinations", d["entries"])
    for i, e in enumerate(d["entries"]):
        if not isinstance(e, dict):
            _bad(f"entries[{i}]", "an object", e)
        for key in ("choice", "time", "memory", "comm_bytes", "flops", "bytes_accessed", "collectives"):
            if key not in e:
                raise ConfigError(f"missing field 'entries[{i}].{key}'")
        c = e["choice"]
        if (not isinstance(c, list) or len(c) != len(space)
                or not all(isinstance(x, int) and 0 <= x < n for x, n in zip(c, space))):
            _bad(f"entries[{i}].choice", f"one strategy index per block within {space}", c)
        for key in ("time", "memory", "comm_bytes", "flops", "bytes_accessed"):
            if not _number(e[key]):
                _bad(f"entries[{i}].{key}", "a finite non-negative number", e[key])
        if e.get("measured") is not None and not _number(e["measured"]):
            _bad(f"entries[{i}].measured", "null or a finite non-negative number", e["measured"])


def cache_load(cache_dir: str | None, key: str) -> SegmentProfile | None:
    """The cached profile of `key`, or None when absent. A file that is not a valid profile (unreadable, not
    JSON, another version, bad types or negative figures) is never used: it is logged as ignored and the
    segment is profiled again (then overwritten), since a cache can always be rebuilt."""
    if not cache_dir:
        return None
    path = os.path.join(cache_dir, key + ".json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            d = json.load(f)
        if not isinstance(d, dict) or d.get("version") != TABLE_VERSION:
            raise ConfigError(f"not a version-{TABLE_VERSION} cache entry")
        if d.get("key") != key:
            raise ConfigError(f"the entry was written for key {d.get('key')!r:.40}")
        return SegmentProfile.from_dict(d.get("segment"))
    except (OSError, ValueError) as e:     # ConfigError is a ValueError
        _log.warning("ignoring unreadable or outdated profile cache file %s (%s); profiling the segment again",
                     path, e)
        return None


def cache_store(cache_dir: str | None, key: str, seg: SegmentProfile) -> None:
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    # atomic: a concurrent reader never sees half a file
    write_json_atomic(os.path.join(cache_dir, key + ".json"), {"version": TABLE_VERSION, "key": key,
                                                                 "segment": seg.to_dict()},
                      indent=None)
