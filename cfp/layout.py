"""The one pipeline layout of heterogeneous 3D-parallel training (FlashFlex/HexiScale semantics).

A `Layout` is a tuple of data-parallel `Pipeline`s; each has its own batch (``batch`` sequences per step in
``chunks`` micro-batches) and a tuple of `Stage`s; each stage holds a number of consecutive transformer
layers on its devices, a <CP,TP> sub-mesh (cp-major; a FlashFlex stage is the cp = 1 case), and, when the
planner made it, the cluster machine the devices belong to. The planner emits a `Layout`, `cfp plan --out`
writes `Layout.to_json()` into its layout file, and `cfp train --layout` and the runtime run
`Layout.from_json()` of it as is. A stage does not know its place; `Layout.placed` gives each stage at its
place (`PlacedStage`: pipeline, index, first layer), which is what the runtime builds programs for.

This module sits below the planner and the runtime and imports neither.
"""
from __future__ import annotations

import functools
import itertools
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from cfp.errors import ConfigError

JSON_VERSION = 2    # of `Layout.to_json`; version 1 was the seed's five lists (hetero_configs, ...)


def _cached_hash(obj, fields: tuple) -> int:
    """`hash(fields)`, kept on `obj` (the dataclass' own hash of its fields, computed once)."""
    h = hash(fields)
    object.__setattr__(obj, "_hash", h)
    return h


@dataclass(frozen=True, eq=True)
class Stage:
    """A stage: `layers` consecutive layers on `devices` (``cp`` x ``tp`` of them, cp-major); `machine` is
    the planner's cluster machine of the devices (None when the layout was not planned)."""
    devices: tuple[int, ...]
    layers: int
    machine: Optional[int] = None
    cp: int = 1

    @property
    def tp(self) -> int:
        return len(self.devices) // self.cp

    def __hash__(self) -> int:      # cached: planning at scale hashes stages millions of times
        h = self.__dict__.get("_hash")
        return _cached_hash(self, (self.devices, self.layers, self.machine, self.cp)) if h is None else h


@dataclass(frozen=True, eq=True)
class Pipeline:
    """A data-parallel replica: `batch` sequences per step in `chunks` micro-batches over its stages."""
    stages: tuple[Stage, ...]
    batch: int
    chunks: int

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        return _cached_hash(self, (self.stages, self.batch, self.chunks)) if h is None else h

    @property
    def micro_batch(self) -> int:
        return self.batch // self.chunks

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return sum(s.layers for s in self.stages)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(itertools.chain.from_iterable(s.devices for s in self.stages))


@dataclass(frozen=True)
class PlacedStage:
    """`stage` at its place in a layout: stage `index` of pipeline `pipeline`, layers from `layer_start`."""
    stage: Stage
    pipeline: int
    index: int
    layer_start: int
    is_last: bool

    @property
    def key(self) -> tuple[int, int]:
        return (self.pipeline, self.index)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def devices(self) -> tuple[int, ...]:
        return self.stage.devices

    @property
    def tp(self) -> int:
        return self.stage.tp

    @property
    def cp(self) -> int:
        return self.stage.cp

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.stage.layers

    @property
    def layer_range(self) -> range:
        return range(self.layer_start, self.layer_end)

    def module_names(self) -> list[str]:
        """Names of the full model's submodules this stage holds (``embed``, ``layers_i``, ``head``)."""
        names = ["embed"] if self.is_first else []
        names += [f"layers_{i}" for i in self.layer_range]
        return names + (["head"] if self.is_last else [])


def _is_int(v: Any) -> bool:
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


@dataclass(frozen=True)
class Layout:
    """All pipelines; the global batch is their batches concatenated in pipeline order. Validated on
    construction: every pipeline holds every layer, batches divide into micro-batches, each device id is a
    non-negative integer used by one stage, each stage's devices are a whole cp x tp grid."""
    pipelines: tuple[Pipeline, ...]

    def __post_init__(self):
        if not self.pipelines:
            raise ConfigError("a layout needs at least one pipeline")
        facts = [_checked(p, pipe) for p, pipe in enumerate(self.pipelines)]
        if len({n for n, _ in facts}) != 1:
            raise ConfigError(f"pipelines hold different numbers of layers {[n for n, _ in facts]}; every "
                              "pipeline holds the whole model")
        if len(set().union(*(ids for _, ids in facts))) != sum(len(ids) for _, ids in facts):
            _name_shared_device(self.pipelines)

    @classmethod
    def unchecked(cls, pipelines: tuple[Pipeline, ...]) -> "Layout":
        """A layout built without `__post_init__`'s checks, for a producer that keeps them by construction and
        builds thousands of candidates (the planner's search, ~10% of its time at 1024 GPUs otherwise); what
        it hands on it passes through `checked`."""
        out = object.__new__(cls)
        object.__setattr__(out, "pipelines", pipelines)
        return out

    def checked(self) -> "Layout":
        """This layout, its checks run (a no-op cost for a layout built the ordinary way)."""
        return Layout(self.pipelines)

    # ------------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        return self.pipelines[0].num_layers

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device id the layout uses, in pipeline then stage order."""
        return tuple(d for p in self.pipelines for d in p.devices)

    @property
    def num_devices(self) -> int:
        return sum(len(p.devices) for p in self.pipelines)

    @property
    def global_batch(self) -> int:
        return sum(p.batch for p in self.pipelines)

    @functools.cached_property
    def placed(self) -> tuple[PlacedStage, ...]:
        """Every stage at its place, in pipeline then stage order."""
        out = []
        for p, pipe in enumerate(self.pipelines):
            start, last = 0, len(pipe.stages) - 1
            for s, st in enumerate(pipe.stages):
                out.append(PlacedStage(st, p, s, start, s == last))
                start += st.layers
        return tuple(out)

    def placed_in(self, pipeline: int) -> tuple[PlacedStage, ...]:
        """The stages of pipeline `pipeline` at their places."""
        start = sum(len(q.stages) for q in self.pipelines[:pipeline])
        return self.placed[start:start + len(self.pipelines[pipeline].stages)]

    def place(self, key: tuple[int, int]) -> PlacedStage:
        """Stage ``key = (pipeline, index)`` at its place."""
        return self.placed_in(key[0])[key[1]]

    def batch_offsets(self) -> list[int]:
        """Row offset of each pipeline's batch inside the concatenated global batch."""
        out, off = [], 0
        for p in self.pipelines:
            out.append(off)
            off += p.batch
        return out

    @property
    def schemes(self) -> list[tuple[int, int, int]]:
        """``(cp, tp, pp)`` of each pipeline (its first stage's degrees)."""
        return [(p.stages[0].cp, p.stages[0].tp, p.num_stages) for p in self.pipelines]

    def without_machines(self) -> "Layout":
        """This layout without the planner's machine annotations (what the runtime runs is the same)."""
        return Layout(tuple(Pipeline(tuple(Stage(s.devices, s.layers, None, s.cp) for s in p.stages), p.batch,
                                     p.chunks) for p in self.pipelines))

    def same_run(self, other: "Layout") -> bool:
        """Whether the runtime runs `other` exactly as this layout (machine annotations aside)."""
        return self.without_machines() == other.without_machines()

    def validate_for(self, num_layers: int, num_devices: Optional[int] = None,
                     heads: Optional[tuple[int, int]] = None) -> "Layout":
        """Check the layout against a model (its layer count; for cfp's own attention its (query, key/value) head
        counts, which every TP degree must divide) and the devices available."""
        if self.num_layers != num_layers:
            raise ConfigError(f"the layout's stages hold {self.num_layers} layers but the model has "
                              f"num_layers={num_layers}")
        for st in self.placed:
            if heads is not None and heads[0] % st.tp:
                raise ConfigError(f"pipeline {st.pipeline} stage {st.index}: TP degree {st.tp} must divide "
                                  f"num_heads={heads[0]}")
        if num_devices is not None:
            bad = [d for p in self.pipelines for d in p.devices if d >= num_devices]
            if bad:
                raise ConfigError(f"layout uses device {bad[0]} ({self.num_devices} devices in all) "
                                  f"but only {num_devices} devices exist (ids 0..{num_devices - 1})")
        return self

    def describe(self) -> str:
        rows = []
        for st in self.placed:
            if st.is_first:
                pipe = self.pipelines[st.pipeline]
                rows.append(f"pipeline {st.pipeline}: batch {pipe.batch} in {pipe.chunks} micro-batches; ")
            else:
                rows[-1] += ", "
            rows[-1] += (f"{f'cp{st.cp} ' if st.cp > 1 else ''}tp{st.tp} L{st.layer_start}-{st.layer_end - 1} "
                         f"dev{list(st.devices)}")
        return "\n".join(rows)

    def summary(self, devices: bool = False) -> str:
        """One line: per pipeline its stages' TP degrees x layers (and device ids) and its micro-batches."""
        def stage(s: Stage) -> str:
            ids = f"[{','.join(map(str, s.devices))}]" if devices else ""
            return f"{f'cp{s.cp}' if s.cp > 1 else ''}tp{s.tp}x{s.layers}L{ids}"
        return " | ".join("+".join(map(stage, p.stages)) + f" ({p.chunks}x{p.micro_batch})" for p in self.pipelines)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        """The layout's JSON document (`from_json` reads it back to an equal layout)."""
        def stage(s: Stage) -> dict:
            out: dict[str, Any] = {"devices": list(s.devices), "layers": s.layers}
            if s.cp != 1:
                out["cp"] = s.cp
            if s.machine is not None:
                out["machine"] = s.machine
            return out
        return {"version": JSON_VERSION,
                "pipelines": [{"batch": p.batch, "chunks": p.chunks, "stages": [stage(s) for s in p.stages]}
                              for p in self.pipelines]}

    @classmethod
    def from_json(cls, data: Any, where: str = "layout") -> "Layout":
        """Validate and build a layout from `to_json`'s document; a bad field raises a one-line
        ConfigError naming its path (``where``.pipelines[p].stages[s].field) and value."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}={_short(data)} must be a mapping with \"version\" and \"pipelines\"")
        if data.get("version") != JSON_VERSION:
            raise ConfigError(f"{where}.version={data.get('version')!r} is not {JSON_VERSION}; regenerate "
                              "the file with this cfp (`cfp plan ... --out FILE`)")
        pipes = _field(data, "pipelines", where, list)
        if not pipes:
            raise ConfigError(f"{where}.pipelines is empty; a layout needs at least one pipeline")
        out = []
        for p, pd in enumerate(pipes):
            at = f"{where}.pipelines[{p}]"
            if not isinstance(pd, Mapping):
                raise ConfigError(f"{at}={_short(pd)} must be a mapping with batch, chunks, stages")
            stages = _field(pd, "stages", at, list)
            if not stages:
                raise ConfigError(f"{at}.stages is empty; a pipeline needs at least one stage")
            out.append(Pipeline(tuple(_stage_from_json(sd, f"{at}.stages[{s}]") for s, sd in enumerate(stages)),
                                _positive(pd, "batch", at), _positive(pd, "chunks", at)))
        try:
            return cls(tuple(out))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    # ------------------------------------------------------------------ the seed's list arguments
    @classmethod
    def from_lists(cls, hetero_configs: Any, layer_partitions: Any, global_batch_size: Any = 1,
                   chunks: Any = 1, devices_id: Optional[Any] = None) -> "Layout":
        """Build from the seed's list arguments (``hetero_configs``, ``layer_partitions``,
        ``global_batch_size``, ``chunks``, ``devices_id``) under its rules: a bare 1-D list is one
        pipeline; per-pipeline lists shorter than the number of pipelines are padded with their last value,
        longer ones are cut; without ``devices_id`` the devices are packed in pipeline, then stage order."""
        tps = _int_rows(hetero_configs, "hetero_configs")
        parts = _int_rows(layer_partitions, "layer_partitions")
        n = len(tps)
        if len(parts) != n:
            raise ConfigError(f"layer_partitions has {len(parts)} pipelines but hetero_configs has {n}")
        for p, (t, l) in enumerate(zip(tps, parts)):
            if len(t) != len(l):
                raise ConfigError(f"layer_partitions[{p}]={l} has {len(l)} stages but "
                                  f"hetero_configs[{p}]={t} has {len(t)}")
        gbs = pad_or_cut(global_batch_size, n, "global_batch_size")
        chk = pad_or_cut(chunks, n, "chunks")
        devs = _devices(tps, devices_id)
        for p, row in enumerate(devs):
            for s, ids in enumerate(row):
                if len(ids) != tps[p][s]:
                    raise ConfigError(f"devices_id[{p}][{s}]={list(ids)} has {len(ids)} devices but the stage's "
                                      f"TP degree is hetero_configs[{p}][{s}]={tps[p][s]}")
        return cls(tuple(Pipeline(tuple(Stage(tuple(devs[p][s]), parts[p][s]) for s in range(len(tps[p]))),
                                  gbs[p], chk[p]) for p in range(n)))

    @classmethod
    def from_schemes(cls, schemes: Sequence[tuple[int, int, int]], num_layers: int,
                     first_device: int = 0) -> "Layout":
        """Hydraulis' notation: one pipeline per ``(cp, tp, pp)``, ``pp`` stages of ``cp x tp``
        consecutive devices each, layers split as evenly as possible (earlier stages take the extra
        ones). Batch sizes are nominal (one row, one micro-batch): a step's micro-batches are given
        to ``HeteroTrainer.step`` per pipeline."""
        pipes, nxt = [], first_device
        for p, shape in enumerate(schemes):
            if not isinstance(shape, (list, tuple)) or len(shape) != 3:
                raise ConfigError(f"pipeline {p}: {shape!r} is not a (cp, tp, pp) triple")
            cp, tp, pp = (_pos_int(v, f"pipeline {p} {n}") for v, n in zip(shape, ("cp", "tp", "pp")))
            if pp > num_layers:
                raise ConfigError(f"pipeline {p}: pp={pp} exceeds the model's {num_layers} layers")
            stages = []
            for s in range(pp):
                stages.append(Stage(tuple(range(nxt, nxt + cp * tp)),
                                    num_layers // pp + (1 if s < num_layers % pp else 0), cp=cp))
                nxt += cp * tp
            pipes.append(Pipeline(tuple(stages), 1, 1))
        return cls(tuple(pipes))

    def lists(self) -> dict[str, list]:
        """The seed's list arguments of this layout (`from_lists` of them gives it back, machines aside)."""
        return {"hetero_configs": [[s.tp for s in p.stages] for p in self.pipelines],
                "layer_partitions": [[s.layers for s in p.stages] for p in self.pipelines],
                "global_batch_size": [p.batch for p in self.pipelines],
                "chunks": [p.chunks for p in self.pipelines],
                "devices_id": [[list(s.devices) for s in p.stages] for p in self.pipelines]}


def _checked(p: int, pipe: Pipeline) -> tuple[int, frozenset]:
    """(layers, device ids) of valid pipeline `p`, checked once per `Pipeline` object (the planner builds
    many layouts from the same pipelines)."""
    facts = pipe.__dict__.get("_facts")
    if facts is None:
        _check_pipeline(p, pipe)
        devices = pipe.devices
        facts = (pipe.num_layers, frozenset(devices))
        if len(facts[1]) != len(devices):
            _name_shared_device((pipe,), p)
        object.__setattr__(pipe, "_facts", facts)
    return facts


def _name_shared_device(pipelines: Sequence[Pipeline], first: int = 0) -> None:
    seen: dict[int, tuple[int, int]] = {}
    for p, pipe in enumerate(pipelines, first):
        for s, st in enumerate(pipe.stages):
            for d in st.devices:
                if d in seen:
                    raise ConfigError(f"device {d} is used by stage {seen[d]} and stage {(p, s)}; each "
                                      "device belongs to one stage")
                seen[d] = (p, s)


def _check_pipeline(p: int, pipe: Pipeline) -> None:
    if not pipe.stages:
        raise ConfigError(f"pipeline {p} has no stages")
    if not _is_int(pipe.batch) or not _is_int(pipe.chunks) or pipe.batch <= 0 or pipe.chunks <= 0 \
            or pipe.batch % pipe.chunks:
        raise ConfigError(f"pipeline {p}: batch={pipe.batch!r} is not a positive multiple of "
                          f"chunks={pipe.chunks!r}")
    for s, st in enumerate(pipe.stages):
        if "_checked" not in st.__dict__:       # once per `Stage` object: pipelines share stages
            _check_stage(p, s, st)
            object.__setattr__(st, "_checked", True)


def _check_stage(p: int, s: int, st: Stage) -> None:
    if not _is_int(st.layers) or st.layers <= 0:
        raise ConfigError(f"pipeline {p} stage {s}: layers={st.layers!r} must be a positive integer")
    if not _is_int(st.cp) or st.cp <= 0 or not st.devices or len(st.devices) % st.cp:
        raise ConfigError(f"pipeline {p} stage {s}: {len(st.devices)} devices {list(st.devices)} are not "
                          f"a whole cp x tp grid with cp={st.cp!r}")
    if set(map(type, st.devices)) != {int} or min(st.devices) < 0:     # the fast test of the loop below
        for d in st.devices:
            if not _is_int(d) or d < 0:
                raise ConfigError(f"pipeline {p} stage {s}: device id {d!r} is not a non-negative integer")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(data: Mapping, key: str, where: str, kind: type) -> Any:
    if key not in data:
        raise ConfigError(f"{where}: missing field {key!r}")
    if not isinstance(data[key], kind):
        raise ConfigError(f"{where}.{key}={_short(data[key])} must be a {kind.__name__}")
    return data[key]


def _positive(data: Mapping, key: str, where: str) -> int:
    v = _field(data, key, where, numbers.Integral)
    if isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{where}.{key}={v!r} must be a positive integer")
    return int(v)


def _stage_from_json(data: Any, where: str) -> Stage:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}={_short(data)} must be a mapping with devices and layers")
    unknown = sorted(set(data) - {"devices", "layers", "cp", "machine"})
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (valid: devices, layers, cp, machine)")
    devices = _field(data, "devices", where, list)
    if not devices or not all(_is_int(d) and d >= 0 for d in devices):
        raise ConfigError(f"{where}.devices={_short(devices)} must be a non-empty list of non-negative integers")
    machine = data.get("machine")
    if machine is not None and (not _is_int(machine) or machine < 0):
        raise ConfigError(f"{where}.machine={machine!r} must be a non-negative integer")
    cp = _positive(data, "cp", where) if "cp" in data else 1
    return Stage(tuple(int(d) for d in devices), _positive(data, "layers", where),
                 None if machine is None else int(machine), cp)


def _pos_int(v: Any, what: str) -> int:
    if not _is_int(v) or v <= 0:
        raise ConfigError(f"{what}={v!r} must be a positive integer")
    return int(v)


def _int_rows(value: Any, name: str) -> list[list[int]]:
    """A 2-D list of positive ints (a bare 1-D list is one pipeline)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{name}={value!r} must be a non-empty 2-D list such as [[2,1,1],[4]]")
    if all(_is_int(v) for v in value):
        value = [value]
    rows = []
    for p, row in enumerate(value):
        if not isinstance(row, (list, tuple)) or not row:
            raise ConfigError(f"{name}[{p}]={row!r} must be a non-empty list of positive integers")
        rows.append([_pos_int(v, f"{name}[{p}][{i}]") for i, v in enumerate(row)])
    return rows


def pad_or_cut(values: Any, n: int, name: str) -> list[int]:
    """The seed's rule: a per-pipeline list is padded with its last value or cut to ``n`` entries."""
    if _is_int(values):
        values = [values]
    if not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(f"{name}={values!r} must be a positive integer or a non-empty list of them")
    vals = [_pos_int(v, f"{name}[{i}]") for i, v in enumerate(values)]
    return (vals + [vals[-1]] * n)[:n]


def _devices(tps: list[list[int]], devices_id: Optional[Any]) -> list[list[tuple]]:
    if devices_id is None:  # packed: consecutive ids in pipeline, then stage order
        out, nxt = [], 0
        for row in tps:
            out.append([tuple(range(nxt + sum(row[:s]), nxt + sum(row[:s + 1]))) for s in range(len(row))])
            nxt += sum(row)
        return out
    if not isinstance(devices_id, (list, tuple)) or len(devices_id) != len(tps):
        raise ConfigError(f"devices_id={devices_id!r} must be a 3-D list with one entry per "
                          f"pipeline ({len(tps)})")
    for p, row in enumerate(devices_id):
        if not isinstance(row, (list, tuple)) or len(row) != len(tps[p]):
            raise ConfigError(f"devices_id[{p}]={row!r} must list device ids for each of the "
                              f"{len(tps[p])} stages")
        for s, ids in enumerate(row):
            if not isinstance(ids, (list, tuple)):
                raise ConfigError(f"devices_id[{p}][{s}]={ids!r} must be a list of device ids")
    return [[tuple(ids) for ids in row] for row in devices_id]
