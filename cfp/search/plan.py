"""Plan files: a searched plan as JSON (per-block strategy and every input's PartitionSpec), loadable without
searching again."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jax.sharding import PartitionSpec

from cfp.analysis.analysis import Analysis
from cfp.errors import PlanError
from cfp.files import write_text_atomic
from cfp.mesh import MeshSpec
from cfp.sharding.specs import StepShardings


def spec_entries(spec: PartitionSpec) -> list:
    """A PartitionSpec as JSON: one entry per dim, None, an axis name or a list of names."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_entries(entries: list) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


PLAN_VERSION = 4     # 2 added `shard_state`, 3 `num_strategies`, 4 `layout`; older files load without them


@dataclasses.dataclass(frozen=True)
class Plan:
    """A saved plan. `input_specs` maps each flat input's path (e.g. "[0]['params']['head']['kernel']") to its
    PartitionSpec entries; parameters and optimizer states are among the inputs of a train step."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    choice: tuple[int, ...]
    strategies: tuple[str, ...]              # notation of each block's strategy, for people
    block_fingerprints: tuple[str, ...]      # checked when the plan is applied to a step
    input_specs: dict[str, list]
    output_specs: tuple[list, ...]
    metrics: dict[str, Any]
    shard_state: tuple[int, ...] = ()       # blocks whose parameters/optimizer state are stored sharded
    version: int = PLAN_VERSION
    # optional, for `cfp explain/diff --plot` (files without them still load): per-block cost-model figures
    # (`cfp.report.figures.BlockFigures.to_dict`) and every profiled combination's time and memory
    estimates: tuple[dict, ...] = ()
    profile: tuple[dict, ...] = ()
    # how many strategies each block has (empty: unknown): a choice outside them is refused on load
    num_strategies: tuple[int, ...] = ()
    # "" for a searched plan (its input specs are the ones its choice gives); else the `Layout` it is
    # (`cfp.baselines.user_layouts`: "data-parallel", "fsdp", "dp-tp" -- input and output shardings alone,
    # nothing constrained inside -- or "alpa-ilp": the choice's blocks, the stored input and output specs)
    layout: str = ""

    @property
    def mesh(self) -> MeshSpec:
        return MeshSpec(self.mesh_shape, self.axis_names)

    def partition_specs(self) -> dict:
        """Input path -> `jax.sharding.PartitionSpec`."""
        return {k: spec_from_entries(v) for k, v in self.input_specs.items()}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    def save(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return write_text_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "Plan":
        """Parse and validate (see `validate_plan_dict`); bad content raises `PlanError` naming `where`."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise PlanError(f"{where} is not JSON: {e}") from None
        validate_plan_dict(d, where)
        return cls(mesh_shape=tuple(d["mesh_shape"]), axis_names=tuple(d["axis_names"]), choice=tuple(d["choice"]),
                   strategies=tuple(d["strategies"]), block_fingerprints=tuple(d["block_fingerprints"]),
                   input_specs=dict(d["input_specs"]), output_specs=tuple(d["output_specs"]),
                   metrics=dict(d["metrics"]), shard_state=tuple(d.get("shard_state", ())), version=PLAN_VERSION,
                   estimates=tuple(d.get("estimates", ())), profile=tuple(d.get("profile", ())),
                   num_strategies=tuple(d.get("num_strategies", ())), layout=d.get("layout", ""))


def make_plan(analysis: Analysis, applied: StepShardings, metrics: dict | None = None,
              estimates: tuple[dict, ...] = (), profile: tuple[dict, ...] = (), layout: str = "") -> Plan:
    g = analysis.graph
    return Plan(mesh_shape=analysis.mesh.shape, axis_names=analysis.mesh.axis_names, choice=applied.choice,
                strategies=tuple(analysis.notation(b, c) for b, c in enumerate(applied.choice)),
                block_fingerprints=tuple(b.fingerprint for b in analysis.blocks),
                input_specs={path: spec_entries(s) for path, s in zip(g.input_paths, applied.input_specs)},
                output_specs=tuple(spec_entries(s) for s in applied.output_specs), metrics=dict(metrics or {}),
                shard_state=applied.shard_state, version=PLAN_VERSION, estimates=tuple(estimates),
                profile=tuple(profile), num_strategies=tuple(len(b.strategies) for b in analysis.blocks),
                layout=getattr(layout, "value", layout))


def check_choice_range(choice, num_strategies, where: str = "plan") -> None:
    """Every block's strategy index must name one of its strategies; raises `PlanError` naming the first
    block that does not (a hand-edited choice would otherwise fail deep inside with an index error)."""
    if len(choice) != len(num_strategies):
        raise PlanError(f"{where}: the choice has {len(choice)} entries, the step {len(num_strategies)} blocks")
    for b, (c, n) in enumerate(zip(choice, num_strategies)):
        if not 0 <= c < n:
            raise PlanError(f"{where}: block {b}'s strategy {c} is out of range: it has {n} strategies "
                            f"(0..{n - 1})")


def load_plan(path: str) -> Plan:
    """Read and validate a plan file; any defect raises `PlanError` naming the file and the field."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read plan file {path!r}: {getattr(e, 'strerror', None) or e}") from None
    return Plan.from_json(text, where=f"plan file {path!r}")


def _fail(where: str, field: str, what: str, value) -> None:
    raise PlanError(f"{where}: field {field!r} must be {what}, got {value!r:.80}")


def _is_int(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _check_spec(where: str, field: str, entries, axes: set) -> None:
    if not isinstance(entries, list):
        _fail(where, field, "a list of per-dim entries (null, an axis name or a list of names)", entries)
    used = []
    for e in entries:
        names = e if isinstance(e, list) else [] if e is None else [e]
        if not all(isinstance(n, str) and n in axes for n in names):
            _fail(where, field, f"entries naming mesh axes {sorted(axes)}", entries)
        used += names
    if len(used) != len(set(used)):       # JAX refuses a spec that shards over one axis twice
        _fail(where, field, "entries naming each mesh axis at most once", entries)


def validate_plan_dict(d, where: str = "plan") -> None:
    """Types, ranges and mesh consistency of a plan's JSON content; raises `PlanError` naming the field."""
    if not isinstance(d, dict):
        raise PlanError(f"{where} must be a JSON object of a cfp plan, got {type(d).__name__}")
    if not _is_int(d.get("version"), 1) or d["version"] > PLAN_VERSION:
        _fail(where, "version", f"one of the supported 1..{PLAN_VERSION}", d.get("version"))
    for key in ("mesh_shape", "axis_names", "choice", "strategies", "block_fingerprints", "input_specs",
                "output_specs", "metrics"):
        if key not in d:
            raise PlanError(f"{where}: missing field {key!r}")
    shape, names, choice = d["mesh_shape"], d["axis_names"], d["choice"]
    if not isinstance(shape, list) or not shape or not all(_is_int(n, 1) for n in shape):
        _fail(where, "mesh_shape", "a non-empty list of positive integers", shape)
    if (not isinstance(names, list) or len(names) != len(shape) or len(set(names)) != len(names)
            or not all(isinstance(n, str) for n in names)):
        _fail(where, "axis_names", f"{len(shape)} distinct axis names (one per mesh_shape entry)", names)
    if not isinstance(choice, list) or not all(_is_int(c, 0) for c in choice):
        _fail(where, "choice", "a list of non-negative strategy indices", choice)
    for key in ("strategies", "block_fingerprints"):
        if not isinstance(d[key], list) or len(d[key]) != len(choice) or not all(isinstance(x, str) for x in d[key]):
            _fail(where, key, f"a list of {len(choice)} strings (one per block of 'choice')", d[key])
    if not isinstance(d["input_specs"], dict):
        _fail(where, "input_specs", "an object mapping input paths to specs", d["input_specs"])
    for path, spec in d["input_specs"].items():
        _check_spec(where, f"input_specs[{path}]", spec, set(names))
    if not isinstance(d["output_specs"], list):
        _fail(where, "output_specs", "a list of specs", d["output_specs"])
    for i, spec in enumerate(d["output_specs"]):
        _check_spec(where, f"output_specs[{i}]", spec, set(names))
    if not isinstance(d["metrics"], dict):
        _fail(where, "metrics", "an object", d["metrics"])
    shard = d.get("shard_state", [])
    if not isinstance(shard, list) or not all(_is_int(b, 0) and b < len(choice) for b in shard):
        _fail(where, "shard_state", f"a list of block indices in 0..{len(choice) - 1}", shard)
    _check_num_strategies(d, where, choice)
    from cfp.baselines.user_layouts import Layout
    if d.get("layout", "") not in ("", *(l.value for l in Layout)):
        _fail(where, "layout", f"\"\" (a searched plan) or one of {[l.value for l in Layout]}", d.get("layout"))
    for key in ("estimates", "profile"):     # optional figures for `cfp explain` (cfp.report)
        value = d.get(key, [])
        if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
            _fail(where, key, "a list of objects", value)


def _check_num_strategies(d: dict, where: str, choice: list) -> None:
    """Plans saved after a search (version 3 on) carry each block's strategy count, and the choice must lie
    within it; an empty or missing list (older files, a `Plan` built by hand) means unknown."""
    n = d.get("num_strategies", [])
    if n == []:
        return
    if not isinstance(n, list) or len(n) != len(choice) or not all(_is_int(x, 1) for x in n):
        _fail(where, "num_strategies", f"a list of {len(choice)} positive integers (one per block)", n)
    check_choice_range(choice, n, where)
