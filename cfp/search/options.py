"""Options of the search pass (profiling included: `SearchOptions`), and parsing of memory sizes such as "2GB" or "512MiB"."""
from __future__ import annotations

import dataclasses
import math
import re

from cfp.errors import ConfigError
from cfp.profiling.options import ProfileOptions

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text) -> int:
    """Bytes from an int or a string like "2GB", "512MB", "1.5GiB" (decimal units; KiB/MiB/GiB binary)."""
    if isinstance(text, bool):
        raise ConfigError(f"memory size {text!r} is not a size like 2GB or 512MB")
    if isinstance(text, (int, float)):
        if not text > 0 or not math.isfinite(text):
            raise ConfigError(f"memory size {text!r} must be a positive, finite number of bytes")
        return int(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"memory size {text!r} is not a size like 2GB, 512MB or 1.5GiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"memory size {text!r} must be positive")
    return value


def fmt_bytes(n: float) -> str:
    """Bytes for people: "1.234 GB", "512.000 KB", "17 B"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """The one record of how a plan is searched, profiling included: `cfp.autoshard`, `cfp search` and the
    stage planner (`cfp train --stage-plans search`) all build it, so the same step and budget give the same
    plan from each. Its defaults are the only ones; the CLI's flags and their `--help` defaults are generated
    from its fields (and those of `profile`, see cfp.cli.flags).

    `profile`: how the segments are profiled (`ProfileOptions`); its `iters` and `warmup` also time the
    verified plans. `memory_per_device`: per-device bytes budget (None: unbounded). `top_k`: per segment, the
    fastest and the leanest profiled combinations the DP keeps. `verify`: how many of the DP's best plans are
    compiled and timed whole (the fastest measured one wins; 0 keeps the DP's best unmeasured).
    `link_gbps`: link bandwidth for resharding estimates (None: the GPU's under `estimate`, else measured).
    `shard_state`: under a budget, also consider each candidate with its parameters and optimizer state
    stored sharded (ZeRO-3) over the axes its strategy replicates them on. `donate`: the step donates its state
    inputs (parameters, optimizer state) to its outputs, so the budget counts those buffers once. `layouts`:
    when verifying, the layouts users write (`cfp.baselines.user_layouts`) and the Alpa-style ILP's plan are
    compiled and timed beside the searched plans, and the fastest that fits is returned.
    `timing_budget`: seconds the side-by-side timing of the verified plans may take: its rounds (at least
    `iters`, at most max(`iters`, 10)) stop once the timed runs have taken that long, so a deep model's slower
    step is timed fewer times rather than for longer. `budget_fraction`: instead of `memory_per_device`, the
    budget as this fraction of plain data parallel's compiled per-device memory (the layout users write, see
    `cfp.baselines.user_layouts`): the search compiles that step first and verifies it as a candidate, so a
    caller need not compile it a second time to work out the budget."""

    profile: ProfileOptions = ProfileOptions()
    memory_per_device: int | None = dataclasses.field(default=None, metadata={
        "text": True, "help": "per-device memory budget, e.g. 2GB or 512MB (default: unbounded)"})
    top_k: int = dataclasses.field(default=4, metadata={
        "help": "fastest and leanest profiled combinations the search keeps per segment"})
    verify: int = dataclasses.field(default=2, metadata={
        "help": "best DP plans compiled and timed whole (0: keep the DP's best unmeasured)"})
    link_gbps: float | None = dataclasses.field(default=None, metadata={
        "help": "link bandwidth (GB/s) of resharding estimates (default: the GPU's under estimate, else "
                "measured)"})
    shard_state: bool = dataclasses.field(default=True, metadata={
        "help": "under a budget, also consider storing parameters/optimizer state sharded (ZeRO-3)"})
    donate: bool = False
    layouts: bool = dataclasses.field(default=True, metadata={
        "help": "also verify, side by side, the layouts users write (data parallel, FSDP, DP x TP by in/out "
                "shardings alone) and the Alpa-style ILP's plan; the fastest that fits wins"})
    timing_budget: float = dataclasses.field(default=10.0, metadata={
        "help": "seconds the side-by-side timing of the verified plans may take"})
    budget_fraction: float | None = None

    def __post_init__(self):
        if not isinstance(self.profile, ProfileOptions):
            raise ConfigError(f"profile={self.profile!r} must be a ProfileOptions")
        if self.memory_per_device is not None:
            object.__setattr__(self, "memory_per_device", parse_bytes(self.memory_per_device))
        for name, lo in (("top_k", 1), ("verify", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}={v!r} must be an integer >= {lo}")
        for name in ("shard_state", "donate", "layouts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        if not _positive_number(self.timing_budget):
            raise ConfigError(f"timing_budget={self.timing_budget!r} must be a positive number of seconds")
        if self.budget_fraction is not None:
            if not _positive_number(self.budget_fraction):
                raise ConfigError(f"budget_fraction={self.budget_fraction!r} must be a positive number (a fraction "
                                  f"of plain data parallel's memory)")
            if self.memory_per_device is not None:
                raise ConfigError("give memory_per_device or budget_fraction, not both")
        if self.link_gbps is not None and not _positive_number(self.link_gbps):
            raise ConfigError(f"link_gbps={self.link_gbps!r} must be a positive number (GB/s)")

    @property
    def iters(self) -> int:
        """Timed runs per measurement: the profile's, and each verified plan's."""
        return self.profile.iters

    @property
    def warmup(self) -> int:
        return self.profile.warmup

    def replace(self, **changes) -> "SearchOptions":
        """A copy with `changes`, each naming a field of this record or of its `profile` (`iters`, `kind`,
        `max_combinations`, ...); a name of neither is a ConfigError."""
        mine = {f.name for f in dataclasses.fields(self)} - {"profile"}
        theirs = {f.name for f in dataclasses.fields(ProfileOptions)}
        unknown = sorted(set(changes) - mine - theirs)
        if unknown:
            raise ConfigError(f"unknown search option(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(sorted(mine | theirs))}")
        profile = dataclasses.replace(self.profile, **{k: v for k, v in changes.items() if k in theirs})
        return dataclasses.replace(self, profile=profile, **{k: v for k, v in changes.items() if k in mine})


def _positive_number(v) -> bool:
    """A finite number > 0 (not a bool, a string, NaN or infinity)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
