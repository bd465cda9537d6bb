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


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cfp", "profiles")


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """How segments are profiled.

    Reduction rule for large spaces: a segment whose full combination space has at most `max_combinations`
    members is profiled exhaustively. Otherwise each block keeps its `per_block` best strategies by the analytic
    cost (predicted collective bytes + dot FLOPs per device), the product of those short lists is ranked by the
    analytic cost of the whole combination (blocks plus resharding between them) and the best
    `max_combinations` are profiled. The rule is printed with every pruned segment.
    """

    kind: ProfilerKind = ProfilerKind.MEASURE
    gpu: str | None = None
    iters: int = 5
    warmup: int = 2
    top_k: int = 4
    cache_dir: str | None = None     # None: no cache
    max_combinations: int = 12
    per_block: int = 2
    overlap_compile: bool = True     # compile combination i+1 in a thread while combination i runs
    progress: bool = True

    def __post_init__(self):
        kind = self.kind
        if isinstance(kind, str):
            try:
                kind = ProfilerKind(kind)
            except ValueError:
                raise ConfigError(f"profiler {self.kind!r} is not one of "
                                  f"{', '.join(k.value for k in ProfilerKind)}") from None
            object.__setattr__(self, "kind", kind)
        if kind is ProfilerKind.ESTIMATE:
            if not self.gpu:
                raise ConfigError("the estimate profiler needs a gpu name (--gpu), e.g. A100-SXM-80G")
            get_gpu(self.gpu)
        elif self.gpu is not None:
            get_gpu(self.gpu)
        for name, lo in (("iters", 3), ("warmup", 0), ("top_k", 1), ("max_combinations", 1), ("per_block", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}={v!r} must be an integer >= {lo}")
