"""Stage plans as records: how they are asked for (`StagePlanOptions`), what one stage's plan is (`StagePlan`, a
small frozen record the planner reads), and every stage's plans of a layout saved as JSON (`StagePlans`)."""
from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, Optional

from cfp.errors import ConfigError
from cfp.files import write_json_atomic
from cfp.profiling.options import default_cache_dir
from cfp.layout import Layout, PlacedStage
from cfp.search.options import SearchOptions
from cfp.search.plan import spec_entries

PLANS_FILE = "stage_plans.json"
PLANS_VERSION = 4   # 2: the analysed step accumulates gradients; Megatron may win a stage. 3: grouped records,
                    # the layout as `Layout.to_json`. 4: any LayeredModel: per-leaf boundary layouts, the batch


def batch_entries(batch_like: Any) -> tuple:
    """A batch's leaves as (key path, shape without its rows, dtype), JSON-friendly."""
    import jax
    return tuple((jax.tree_util.keystr(p), tuple(int(d) for d in l.shape[1:]), str(l.dtype))
                 for p, l in jax.tree_util.tree_flatten_with_path(batch_like)[0])


def entries(spec) -> tuple:
    """A PartitionSpec as hashable, JSON-friendly entries."""
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec_entries(spec))


class StagePlanMode(enum.Enum):
    MEGATRON = "megatron"   # fixed Megatron rules (cfp.runtime.sharding), activations replicated
    SEARCH = "search"       # CFP analysis + profiling + search per stage
    SAVED = "saved"         # stage plans saved earlier (a directory), reused without searching


@dataclasses.dataclass(frozen=True)
class StagePlanOptions:
    """How stage plans are made: `mode`, the `directory` of SAVED plans and, under SEARCH, how each stage is
    searched: `search`, the `SearchOptions` that `cfp.autoshard` and `cfp search` take (the same record, the
    same defaults), its `memory_per_device` every stage's per-device budget. A stage search uses the default
    profile cache when `search.profile.cache_dir` is None (so a second run with the same stages profiles
    nothing) and shows no progress bar."""

    mode: StagePlanMode = StagePlanMode.MEGATRON
    directory: Optional[str] = None          # SAVED: where the plans are
    search: SearchOptions = SearchOptions()

    def __post_init__(self):
        mode = self.mode
        if isinstance(mode, str):
            try:
                mode = StagePlanMode(mode)
            except ValueError:
                raise ConfigError(f"stage plans {self.mode!r} is not one of megatron, search or a "
                                  "directory of saved stage plans") from None
            object.__setattr__(self, "mode", mode)
        if (mode is StagePlanMode.SAVED) != bool(self.directory):
            raise ConfigError("saved stage plans need a directory (and only they take one)")
        if not isinstance(self.search, SearchOptions):
            raise ConfigError(f"search={self.search!r} must be a SearchOptions")

    @classmethod
    def parse(cls, text: str, search: Optional[SearchOptions] = None) -> "StagePlanOptions":
        """`megatron`, `search` or a directory of saved stage plans (the CLI's --stage-plans)."""
        search = search or SearchOptions()
        if text in (m.value for m in (StagePlanMode.MEGATRON, StagePlanMode.SEARCH)):
            return cls(StagePlanMode(text), search=search)
        if not os.path.isfile(os.path.join(text, PLANS_FILE)):
            raise ConfigError(f"--stage-plans {text!r} is neither megatron, search nor a directory holding "
                              f"{PLANS_FILE}")
        return cls(StagePlanMode.SAVED, directory=text, search=search)

    def search_options(self) -> SearchOptions:
        """`search` as a stage search runs it: the default profile cache unless one is named, no progress bar, and
        no whole-step user layouts (a stage picks among the searched choices, `plan_search._pick`)."""
        return self.search.replace(cache_dir=self.search.profile.cache_dir or default_cache_dir(), progress=False,
                                   layouts=False)


@dataclasses.dataclass(frozen=True)
class SearchedSharding:
    """A searched choice: per-block strategy indices `choice` with their `strategies` notation, the blocks
    whose state is stored sharded, each parameter's PartitionSpec entries by key path, and the activation
    layouts at the stage's boundaries: `act_in` per leaf of its input (the micro-batch on the first stage, else the
    activation), `act_out` per differentiable leaf of its output activation (empty on the last stage)."""
    choice: tuple[int, ...]
    strategies: tuple[str, ...]
    shard_state: tuple[int, ...] = ()
    params: tuple[tuple[str, tuple], ...] = ()
    act_in: tuple = ()
    act_out: tuple = ()


@dataclasses.dataclass(frozen=True)
class Timing:
    """One sharding's figures per micro-batch step: seconds (the stage's runtime programs measured side by
    side with the other sharding's -- fwd, bwd and a share of the update -- or the whole step estimated), the
    boundary transfer (estimated) and per-device bytes (compiled; 0 when not compiled)."""
    time: float
    boundary_time: float = 0.0
    memory: int = 0


@dataclasses.dataclass(frozen=True)
class SearchFigures:
    """How a stage was searched: the searched choice's and Megatron's `Timing` (None: not compared side by
    side), the profiler ("measure" or "estimate:<gpu>"), the profile's compiles and the seconds planning took."""
    searched: Timing
    megatron: Optional[Timing] = None
    profiler: str = ""
    profile_compiles: int = 0
    planning_time: float = 0.0


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's plan: which stage (pipeline, index, TP degree, layers [start, end), micro-batch), its
    searched `sharding` (None: one device, everything replicated), the search's `figures`, and whether the
    stage's Megatron sharding runs instead (`megatron`: it was faster side by side, or the same sharding)."""

    pipeline: int
    stage: int
    tp: int
    layers: tuple[int, int]
    micro_batch_size: int
    sharding: Optional[SearchedSharding] = None
    figures: Optional[SearchFigures] = None
    megatron: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.pipeline, self.stage)

    @property
    def runs_searched(self) -> bool:
        """Whether the runtime runs the searched choice (not the Megatron rules, not one replicated device)."""
        return self.sharding is not None and not self.megatron

    def plan_choice(self) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(choice, blocks with sharded state) of the sharding that runs; None: the Megatron rules."""
        return (self.sharding.choice, self.sharding.shard_state) if self.runs_searched else None

    def measured_time(self) -> Optional[float]:
        """Seconds per micro-batch of the sharding that runs, measured on this host; None when the stage was
        not searched (one device) or its times are estimates."""
        f = self.figures
        if self.sharding is None or f is None or f.profiler != "measure":
            return None
        # a searched plan that is Megatron's sharding was not timed against itself (megatron time 0): the
        # search's own time of that sharding stands
        return f.megatron.time if self.megatron and f.megatron and f.megatron.time else f.searched.time

    def matches(self, st: PlacedStage, micro_batch_size: int) -> bool:
        return (self.key == st.key and self.tp == st.tp and tuple(self.layers) == (st.layer_start, st.layer_end)
                and self.micro_batch_size == micro_batch_size)

    def summary(self) -> str:
        """How many blocks/parameters the plan shards and the activation layouts at its boundaries."""
        s = self.sharding
        if s is None:
            return "replicated (1 device)"
        if self.megatron:
            return "Megatron sharding (the searched plan was slower side by side, or was the Megatron sharding)"
        sharded = sum(1 for _, e in s.params if any(x is not None for x in e))
        fmt = lambda es: ", ".join("P(" + ", ".join(map(str, e)) + ")" for e in es) or "-"
        return (f"{len(s.choice)} blocks, {len(set(s.strategies))} distinct strategies, "
                f"{sharded}/{len(s.params)} parameters sharded"
                + (f" (state sharded in {len(s.shard_state)} blocks)" if s.shard_state else "")
                + f", activation in {fmt(s.act_in)} out {fmt(s.act_out)}")


@dataclasses.dataclass(frozen=True)
class StagePlans:
    """Every stage's plan for one model and layout; saved as JSON in a directory. `config`: the model config
    the stages were searched for (its fields), `device`: the kind of device their times were taken on
    ("cpu" here), so `cfp plan --stage-times` can use measured stage times for stages of the same shape."""

    model: str
    layout: Layout
    plans: tuple[StagePlan, ...]
    config: dict = dataclasses.field(default_factory=dict)
    device: str = ""
    batch: tuple = ()    # the batch the stages were searched for: (key path, shape without rows, dtype) per leaf

    def by_key(self) -> dict[tuple[int, int], StagePlan]:
        return {p.key: p for p in self.plans}

    def check(self, layout: Layout, model: str, batch_like: Any = None) -> "StagePlans":
        """Raise ConfigError unless every stage of `layout` has a plan made for it (and, given `batch_like`, for
        batches of its shapes)."""
        if model != self.model:
            raise ConfigError(f"stage plans were made for model {self.model!r}, not {model!r}")
        if batch_like is not None and self.batch and batch_entries(batch_like) != self.batch:
            raise ConfigError(f"stage plans were made for batches {list(self.batch)}, not "
                              f"{list(batch_entries(batch_like))}; search again for these batches")
        by_key = self.by_key()
        for st in layout.placed:
            p, mb = by_key.get(st.key), layout.pipelines[st.pipeline].micro_batch
            if p is None or not p.matches(st, mb):
                raise ConfigError(f"stage plans (layout {self.layout.summary()}) have no plan for stage {st.key} "
                                  f"(TP {st.tp}, layers {st.layer_start}..{st.layer_end - 1}, micro-batch "
                                  f"{mb}); search again for this layout")
        return self

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        return write_json_atomic(os.path.join(directory, PLANS_FILE),
                                 {"version": PLANS_VERSION, **dataclasses.asdict(self),
                                  "layout": self.layout.to_json()})

    @classmethod
    def load(cls, directory: str) -> "StagePlans":
        path = os.path.join(directory, PLANS_FILE)
        try:
            with open(path) as f:
                d = json.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read stage plans {path!r}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"stage plans {path!r} are not JSON: {e}") from None
        if d.get("version") != PLANS_VERSION:
            raise ConfigError(f"stage plans {path!r} have version {d.get('version')!r}, expected {PLANS_VERSION}")
        layout = Layout.from_json(d.get("layout"), f"stage plans {path!r}: layout")
        try:
            plans = tuple(_plan_from_dict(p) for p in d["plans"])
            return cls(str(d["model"]), layout, plans, dict(d.get("config", {})),
                       str(d.get("device", "")), tuple(tuple(_nested(e)) for e in d.get("batch", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"stage plans {path!r} are malformed: {e!r}") from None


def _nested(x):
    return tuple(_nested(v) for v in x) if isinstance(x, list) else x


def _record(cls, d: dict):
    """`cls` from its JSON dict (lists back to tuples); unknown keys are a ValueError."""
    return cls(**{k: _nested(v) for k, v in d.items()})


def _plan_from_dict(d: dict) -> StagePlan:
    d = dict(d)
    if d.get("sharding") is not None:
        s = dict(d["sharding"])
        s["params"] = [[str(k), e] for k, e in s.get("params", ())]
        d["sharding"] = _record(SearchedSharding, s)
    if d.get("figures") is not None:
        f = dict(d["figures"])
        f["searched"] = _record(Timing, f["searched"])
        f["megatron"] = _record(Timing, f["megatron"]) if f.get("megatron") is not None else None
        d["figures"] = SearchFigures(**f)
    return StagePlan(**{k: (_nested(v) if k == "layers" else v) for k, v in d.items()})


def report_lines(plans: StagePlans, layout: Layout, busy: dict) -> list[str]:
    """Per stage: strategy summary, memory, the search's step time x micro-batches vs the measured busy time.

    The search's time is one micro-batch's forward+backward+update (measured under the `measure` profiler on
    this host, estimated under `estimate`); the runtime's busy time is the stage's measured fwd + bwd (what its
    recompute policy recomputes included) over all its micro-batches per step, without the update."""
    out = []
    for p in plans.plans:
        chunks = layout.pipelines[p.pipeline].chunks
        line = f"stage plan p{p.pipeline}s{p.stage} TP {p.tp}: {p.summary()}"
        f = p.figures
        if p.sharding is not None and f is not None:
            kind = "estimated" if f.profiler.startswith("estimate") else "measured in search"
            line += (f"; searched: {f.searched.memory / 2**20:.2f} MiB per device (compiled), step {kind} "
                     f"{f.searched.time * chunks:.4f} s ({chunks} micro-batches) + boundary estimated "
                     f"{f.searched.boundary_time * chunks:.4f} s")
        if f is not None and f.megatron is not None and f.megatron.time:
            m = f.megatron
            mem = f"{m.memory / 2**20:.2f} MiB per device (compiled), " if m.memory else ""
            line += (f"; Megatron side by side: {mem}step {m.time * chunks:.4f} s + boundary "
                     f"{m.boundary_time * chunks:.4f} s; {'Megatron' if p.megatron else 'searched'} runs")
        if p.key in busy:
            line += f"; busy measured {busy[p.key]:.4f} s/step"
        out.append(line)
    return out
