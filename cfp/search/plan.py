"""Plan files: a searched plan as JSON (per-block strategy and every input's PartitionSpec), loadable without
searching again."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

from jax.sharding import PartitionSpec

from cfp.analysis.analysis import Analysis, analyze_with_program
from cfp.errors import ConfigError
from cfp.mesh import MeshSpec
from cfp.sharding.specs import StepShardings
from cfp.sharding.step import ShardedStep, apply_choice


def spec_entries(spec: PartitionSpec) -> list:
    """A PartitionSpec as JSON: one entry per dim, None, an axis name or a list of names."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_entries(entries: list) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


PLAN_VERSION = 2     # 2 added `shard_state`; version 1 files load with none


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
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        if d.get("version") not in (1, PLAN_VERSION):
            raise ConfigError(f"plan version {d.get('version')!r} is not one of the supported 1..{PLAN_VERSION}")
        return cls(tuple(d["mesh_shape"]), tuple(d["axis_names"]), tuple(d["choice"]), tuple(d["strategies"]),
                   tuple(d["block_fingerprints"]), dict(d["input_specs"]), tuple(d["output_specs"]),
                   dict(d["metrics"]), tuple(d.get("shard_state", ())), PLAN_VERSION,
                   tuple(d.get("estimates", ())), tuple(d.get("profile", ())))


def make_plan(analysis: Analysis, applied: StepShardings, metrics: dict | None = None,
              estimates: tuple[dict, ...] = (), profile: tuple[dict, ...] = ()) -> Plan:
    g = analysis.graph
    return Plan(analysis.mesh.shape, analysis.mesh.axis_names, applied.choice,
                tuple(analysis.notation(b, c) for b, c in enumerate(applied.choice)),
                tuple(b.fingerprint for b in analysis.blocks),
                {path: spec_entries(s) for path, s in zip(g.input_paths, applied.input_specs)},
                tuple(spec_entries(s) for s in applied.output_specs), dict(metrics or {}), applied.shard_state,
                PLAN_VERSION, tuple(estimates), tuple(profile))


def load_plan(path: str) -> Plan:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read plan file {path!r}: {e.strerror}") from None
    try:
        return Plan.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"plan file {path!r} is not a cfp plan: {e}") from None


def apply_saved_plan(plan: Plan | str, step_fn: Callable, *example_args, mesh=None) -> ShardedStep:
    """Shard `step_fn` with a saved plan (a `Plan` or a path); the step must have the plan's block structure."""
    if isinstance(plan, str):
        plan = load_plan(plan)
    analysis, program = analyze_with_program(step_fn, *example_args, mesh=mesh if mesh is not None else plan.mesh)
    if tuple(analysis.mesh.shape) != tuple(plan.mesh_shape):
        raise ConfigError(f"plan is for mesh {plan.mesh_shape}, the step was given mesh {analysis.mesh.shape}")
    fps = tuple(b.fingerprint for b in analysis.blocks)
    if fps != plan.block_fingerprints:
        raise ConfigError(f"plan has {len(plan.block_fingerprints)} blocks that do not match this step's "
                          f"{len(fps)} blocks; search again for this step")
    step = apply_choice(program, analysis, plan.choice, mesh if hasattr(mesh, "devices") else None,
                      shard_state=plan.shard_state)
    step.saved_plan = plan
    return step
