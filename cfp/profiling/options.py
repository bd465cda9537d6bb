"""Options of the profiling pass."""
from __future__ import annotations

import dataclasses
import enum
import os

from cfp.errors import ConfigError
from cfp.hardware.gpus import get_gpu


class ProfilerKind(enum.Enum):
    MEASURE = "measure"     # compile and time on the local devices
    ESTIMATE = "estimate"   # compile, then a cost model of a catalog GPU on compiled FLOPs/bytes/collectives


@dataclasses.dataclass(frozen=True)
class ProfilerSpec:
    """Which profiler made a profile table: `measure`, or `estimate` with its catalog GPU.

    Written to JSON as "measure" or "estimate:<gpu>" (`str`), read back with `parse`."""

    kind: ProfilerKind
    gpu: str | None = None      # the catalog GPU of `estimate`

    def __str__(self) -> str:
        return self.kind.value if self.kind is ProfilerKind.MEASURE else f"{self.kind.value}:{self.gpu}"

    @classmethod
    def parse(cls, text: str) -> "ProfilerSpec":
        kind, _, gpu = text.partition(":")
        try:
            return cls(ProfilerKind(kind), gpu or None)
        except ValueError:
            raise ConfigError(f"profiler {text!r} is not 'measure' or 'estimate:<gpu>'") from None


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cfp", "profiles")


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """How segments are profiled.

    Reduction rule for large spaces: a segment whose full choice space has at most `max_combinations` members
    is profiled exhaustively. Otherwise each block keeps its `per_block` best strategies by the analytic cost
    (dot FLOPs per device and predicted collectives, timed on `gpu` or the default ranking GPU) plus its leanest
    strategy in memory; of the product of those short lists, the data-parallel choice (always: the search
    calibrates its memory sums on it), the `max_combinations // 4` leanest by estimated memory and then the
    best by analytic cost including resharding between the blocks are profiled, `max_combinations` in all.
    Those leanest and best are ranked exactly while the product has at most `pool_limit` combinations, and
    by a beam search keeping the `pool_limit` best partial combinations block by block beyond (memory and
    time linear in the segment's length, never the full product; on segments of more than ~1000 blocks the
    width shrinks so the beam stays within ~8M picks). The rule is printed with every pruned segment.
    """

    # `help` metadata: the field is a flag of `cfp profile`/`cfp search`, generated with this record's default
    # (cfp.cli.flags); `flag` names it where the field's name would read badly on the command line
    kind: ProfilerKind = dataclasses.field(default=ProfilerKind.MEASURE, metadata={
        "flag": "profiler", "help": "measure: time on the local devices; estimate: cost model of --gpu"})
    gpu: str | None = dataclasses.field(default=None, metadata={
        "help": "catalog GPU of --profiler estimate (e.g. A100-SXM-80G); under measure, ranks pruned spaces"})
    iters: int = dataclasses.field(default=5, metadata={"help": "timed runs per measurement (>= 3)"})
    warmup: int = dataclasses.field(default=2, metadata={"help": "untimed runs before each measurement"})
    cache_dir: str | None = None     # None: no cache (the CLI and the stage planner default to the user cache)
    max_combinations: int = dataclasses.field(default=12, metadata={
        "help": "combinations profiled per segment kind; larger spaces are pruned by analytic cost"})
    per_block: int = dataclasses.field(default=2, metadata={
        "help": "strategies kept per block when a segment's space is pruned"})
    pool_limit: int = 8192           # exact ranking up to this many combinations, a beam this wide beyond
    overlap_compile: bool = True     # compile combination i+1 in a thread while combination i runs
    progress: bool = dataclasses.field(default=True, metadata={"help": "progress bar while profiling"})

    def __post_init__(self):
        kind = self.kind
        if not isinstance(kind, ProfilerKind):
            try:
                kind = ProfilerKind(kind)
            except ValueError:
                raise ConfigError(f"profiler {self.kind!r} is not one of "
                                  f"{', '.join(k.value for k in ProfilerKind)}") from None
            object.__setattr__(self, "kind", kind)
        if kind is ProfilerKind.ESTIMATE and not self.gpu:
            raise ConfigError("the estimate profiler needs a gpu name (--gpu), e.g. A100-SXM-80G")
        if self.gpu is not None:    # the catalog's name: one GPU spelled two ways is one profile (cache key)
            object.__setattr__(self, "gpu", get_gpu(self.gpu).name)
        for name, lo in (("iters", 3), ("warmup", 0), ("max_combinations", 1), ("per_block", 1),
                        ("pool_limit", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}={v!r} must be an integer >= {lo}")
        for name in ("overlap_compile", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
