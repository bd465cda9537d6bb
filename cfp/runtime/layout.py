"""Heterogeneous 3D-parallel layout (FlashFlex/HexiScale semantics), validated.

A layout is a list of data-parallel *pipelines*; each pipeline has its own global batch size and
micro-batch count (``chunks``) and a list of *stages*; each stage has its own tensor-parallel degree,
contiguous range of transformer layers and device ids.  ``HeteroLayout.from_lists`` takes the seed's
list arguments (``hetero_configs``, ``layer_partitions``, ``global_batch_size``, ``chunks``,
``devices_id``) and applies its rules: per-pipeline lists shorter than the number of pipelines are
padded with their last value, longer ones are cut.
"""
from __future__ import annotations

import ast
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cfp.errors import ConfigError


def parse_nested_list(text: str, name: str) -> Any:
    """Parse a Python literal list such as ``"[[2,1,1],[4]]"`` (trailing commas allowed)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"{name}={text!r} is not a Python list literal, e.g. \"[[2,1,1],[4]]\"") from None
    if isinstance(value, tuple):
        value = list(value)
    return value


def _pos_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ConfigError(f"{what}={v!r} must be a positive integer")
    return int(v)


def _int_rows(value: Any, name: str, allow_zero: bool = False) -> list[list[int]]:
    """A 2-D list of positive ints (a bare 1-D list is one pipeline)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{name}={value!r} must be a non-empty 2-D list such as [[2,1,1],[4]]")
    if all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        value = [value]
    rows = []
    for p, row in enumerate(value):
        if not isinstance(row, (list, tuple)) or not row:
            raise ConfigError(f"{name}[{p}]={row!r} must be a non-empty list of positive integers")
        rows.append([_pos_int(v, f"{name}[{p}][{i}]") for i, v in enumerate(row)])
    return rows


def pad_or_cut(values: Any, n: int, name: str) -> list[int]:
    """The seed's rule: a per-pipeline list is padded with its last value or cut to ``n`` entries."""
    if isinstance(values, numbers.Integral) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(f"{name}={values!r} must be a positive integer or a non-empty list of them")
    vals = [_pos_int(v, f"{name}[{i}]") for i, v in enumerate(values)]
    return (vals + [vals[-1]] * n)[:n]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a <CP,TP> sub-mesh of ``cp * tp`` devices (cp-major), layers
    ``[layer_start, layer_end)``.  ``cp`` > 1 shards the sequence of every micro-batch over the stage's
    ``cp`` axis (context-parallel attention); a FlashFlex layout is the ``cp = 1`` case."""
    pipeline: int
    index: int
    tp: int
    layer_start: int
    layer_end: int
    devices: tuple[int, ...]
    is_first: bool
    is_last: bool
    cp: int = 1

    @property
    def key(self) -> tuple[int, int]:
        return (self.pipeline, self.index)

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    def module_names(self) -> list[str]:
        """Names of the full model's submodules this stage holds (``embed``, ``layers_i``, ``head``)."""
        names = ["embed"] if self.is_first else []
        names += [f"layers_{i}" for i in self.layers]
        return names + (["head"] if self.is_last else [])


@dataclass(frozen=True)
class Pipeline:
    """A data-parallel replica: its own batch (``global_batch_size`` rows) in ``chunks`` micro-batches."""
    index: int
    stages: tuple[Stage, ...]
    global_batch_size: int
    chunks: int

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.chunks

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages for d in s.devices)


@dataclass(frozen=True)
class HeteroLayout:
    """All pipelines; the global batch is their batches concatenated in pipeline order."""
    pipelines: tuple[Pipeline, ...]

    def __post_init__(self):
        if not self.pipelines:
            raise ConfigError("a layout needs at least one pipeline")
        n_layers = {p.stages[-1].layer_end for p in self.pipelines}
        if len(n_layers) != 1:
            raise ConfigError(f"pipelines cover different numbers of layers {sorted(n_layers)}")
        seen: dict[int, tuple[int, int]] = {}
        for p in self.pipelines:
            if p.global_batch_size % p.chunks:
                raise ConfigError(
                    f"pipeline {p.index}: global_batch_size={p.global_batch_size} is not divisible "
                    f"by chunks={p.chunks}")
            for s in p.stages:
                if len(s.devices) != s.tp * s.cp:
                    degree = f"TP degree is {s.tp}" if s.cp == 1 else f"CP x TP degree is {s.cp} x {s.tp}"
                    raise ConfigError(f"devices_id[{p.index}][{s.index}]={list(s.devices)} has "
                                      f"{len(s.devices)} devices but the stage's {degree}")
                for d in s.devices:
                    if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
                        raise ConfigError(f"devices_id[{p.index}][{s.index}] has device id {d!r}; "
                                          "ids are non-negative integers")
                    if d in seen:
                        raise ConfigError(f"device {d} is used by stage {seen[d]} and stage "
                                          f"{s.key}; each device belongs to one stage")
                    seen[d] = s.key

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_lists(cls, hetero_configs: Any, layer_partitions: Any, global_batch_size: Any = 1,
                   chunks: Any = 1, devices_id: Optional[Any] = None) -> "HeteroLayout":
        """Build from the seed's arguments; strings are parsed as Python list literals."""
        if isinstance(hetero_configs, str):
            hetero_configs = parse_nested_list(hetero_configs, "hetero_configs")
        if isinstance(layer_partitions, str):
            layer_partitions = parse_nested_list(layer_partitions, "layer_partitions")
        if isinstance(devices_id, str):
            devices_id = parse_nested_list(devices_id, "devices_id")
        tps = _int_rows(hetero_configs, "hetero_configs")
        parts = _int_rows(layer_partitions, "layer_partitions")
        n = len(tps)
        if len(parts) != n:
            raise ConfigError(f"layer_partitions has {len(parts)} pipelines but hetero_configs has {n}")
        for p, (t, l) in enumerate(zip(tps, parts)):
            if len(t) != len(l):
                raise ConfigError(f"layer_partitions[{p}]={l} has {len(l)} stages but "
                                  f"hetero_configs[{p}]={t} has {len(t)}")
        totals = {sum(l) for l in parts}
        if len(totals) != 1:
            raise ConfigError(f"layer_partitions rows sum to different layer counts "
                              f"{[sum(l) for l in parts]}; every pipeline holds the whole model")
        gbs = pad_or_cut(global_batch_size, n, "global_batch_size")
        chk = pad_or_cut(chunks, n, "chunks")
        devs = cls._devices(tps, devices_id)
        pipes = []
        for p in range(n):
            stages, start = [], 0
            for s, (tp, nl) in enumerate(zip(tps[p], parts[p])):
                stages.append(Stage(p, s, tp, start, start + nl, tuple(devs[p][s]),
                                    s == 0, s == len(tps[p]) - 1))
                start += nl
            pipes.append(Pipeline(p, tuple(stages), gbs[p], chk[p]))
        return cls(tuple(pipes))

    @classmethod
    def from_schemes(cls, schemes: Sequence[tuple[int, int, int]], num_layers: int,
                     first_device: int = 0) -> "HeteroLayout":
        """Hydraulis' notation: one pipeline per ``(cp, tp, pp)``, ``pp`` stages of ``cp x tp``
        consecutive devices each, layers split as evenly as possible (earlier stages take the extra
        ones).  Batch sizes are nominal (one row, one micro-batch): a step's micro-batches are given
        to ``HeteroTrainer.step`` per pipeline."""
        pipes, nxt = [], first_device
        for p, shape in enumerate(schemes):
            if not isinstance(shape, (list, tuple)) or len(shape) != 3:
                raise ConfigError(f"pipeline {p}: {shape!r} is not a (cp, tp, pp) triple")
            cp, tp, pp = (_pos_int(v, f"pipeline {p} {n}") for v, n in zip(shape, ("cp", "tp", "pp")))
            if pp > num_layers:
                raise ConfigError(f"pipeline {p}: pp={pp} exceeds the model's {num_layers} layers")
            sizes = [num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)]
            stages, start = [], 0
            for s, n in enumerate(sizes):
                devs = tuple(range(nxt, nxt + cp * tp))
                stages.append(Stage(p, s, tp, start, start + n, devs, s == 0, s == pp - 1, cp))
                start, nxt = start + n, nxt + cp * tp
            pipes.append(Pipeline(p, tuple(stages), 1, 1))
        return cls(tuple(pipes))

    @property
    def schemes(self) -> list[tuple[int, int, int]]:
        """``(cp, tp, pp)`` of each pipeline (its first stage's degrees)."""
        return [(p.stages[0].cp, p.stages[0].tp, p.num_stages) for p in self.pipelines]

    @staticmethod
    def _devices(tps: list[list[int]], devices_id: Optional[Any]) -> list[list[list[int]]]:
        if devices_id is None:  # packed: consecutive ids in pipeline, then stage order
            out, nxt = [], 0
            for row in tps:
                out.append([list(range(nxt + sum(row[:s]), nxt + sum(row[:s + 1])))
                            for s in range(len(row))])
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
        return [[list(ids) for ids in row] for row in devices_id]

    # ------------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        return self.pipelines[0].stages[-1].layer_end

    @property
    def num_devices(self) -> int:
        return sum(len(p.devices) for p in self.pipelines)

    @property
    def total_batch_size(self) -> int:
        return sum(p.global_batch_size for p in self.pipelines)

    @property
    def stages(self) -> list[Stage]:
        return [s for p in self.pipelines for s in p.stages]

    def stage(self, key: tuple[int, int]) -> Stage:
        return self.pipelines[key[0]].stages[key[1]]

    def batch_offsets(self) -> list[int]:
        """Row offset of each pipeline's batch inside the concatenated global batch."""
        out, off = [], 0
        for p in self.pipelines:
            out.append(off)
            off += p.global_batch_size
        return out

    def holder(self, pipeline: int, module: str) -> Stage:
        """The stage of ``pipeline`` that holds submodule ``module``."""
        for s in self.pipelines[pipeline].stages:
            if module in s.module_names():
                return s
        raise KeyError(module)

    def validate_for(self, config: Any, num_devices: Optional[int] = None) -> "HeteroLayout":
        """Check the layout against a model config (layers, heads) and the devices available."""
        if self.num_layers != config.num_layers:
            raise ConfigError(f"layer_partitions rows sum to {self.num_layers} but the model has "
                              f"num_layers={config.num_layers}")
        for s in self.stages:
            if config.num_heads % s.tp:
                raise ConfigError(f"hetero_configs[{s.pipeline}][{s.index}]={s.tp}: TP degree must "
                                  f"divide num_heads={config.num_heads}")
        if num_devices is not None:
            bad = [d for s in self.stages for d in s.devices if d >= num_devices]
            if bad:
                raise ConfigError(f"layout uses device {bad[0]} ({self.num_devices} devices in all) "
                                  f"but only {num_devices} devices exist (ids 0..{num_devices - 1})")
        return self

    def describe(self) -> str:
        rows = []
        for p in self.pipelines:
            st = ", ".join(f"{f'cp{s.cp} ' if s.cp > 1 else ''}tp{s.tp} L{s.layer_start}-"
                           f"{s.layer_end - 1} dev{list(s.devices)}" for s in p.stages)
            rows.append(f"pipeline {p.index}: batch {p.global_batch_size} in {p.chunks} "
                        f"micro-batches; {st}")
        return "\n".join(rows)


def layout_lists(layout: HeteroLayout) -> dict[str, Sequence]:
    """The seed's list form of a layout (for checkpoint metadata and logs)."""
    out = {
        "hetero_configs": [[s.tp for s in p.stages] for p in layout.pipelines],
        "layer_partitions": [[s.layer_end - s.layer_start for s in p.stages] for p in layout.pipelines],
        "global_batch_size": [p.global_batch_size for p in layout.pipelines],
        "chunks": [p.chunks for p in layout.pipelines],
        "devices_id": [[list(s.devices) for s in p.stages] for p in layout.pipelines],
    }
    if any(s.cp > 1 for s in layout.stages):
        out["context_parallel"] = [[s.cp for s in p.stages] for p in layout.pipelines]
    return out
