"""Recomputation: what a pipeline stage's backward recomputes of its forward, one policy per stage.

* ``none`` -- the forward returns what its backward needs (the VJP residuals) and the backward runs only the
  backward: the least compute, the most kept activation memory per in-flight micro-batch;
* ``selective`` -- the residuals less the large, cheap-to-recompute tensors (attention scores and
  probabilities): only the matmul outputs without batch dims are saved
  (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); the rest is recomputed in the backward;
* ``full`` -- only the stage input is kept; the backward runs the forward again (Megatron's full recompute).

``auto`` is a request, not a policy: the planner resolves it per stage to the least recomputation whose kept
activations fit that stage's memory under its schedule. The runtime runs resolved policies only.

This module sits on the floor (below the planner and the runtime) and imports neither.
"""
from __future__ import annotations

import enum
from typing import Any, Sequence

from cfp.errors import ConfigError


class Recompute(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: Any, what: str = "recompute") -> "Recompute":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower()) if isinstance(value, str) else cls(value)
        except ValueError:
            raise ConfigError(f"{what}={value!r} is not one of {', '.join(v.value for v in cls)}") from None

    @classmethod
    def policy(cls, value: Any, what: str = "recompute") -> "Recompute":
        """A resolved policy (``none``, ``selective`` or ``full``); ``auto`` is refused."""
        out = cls.parse(value, what)
        if out is cls.AUTO:
            raise ConfigError(f"{what}='auto' is a request for the planner, not a policy a stage runs: give "
                              "none, selective or full (or plan the layout with `cfp plan --recompute auto`)")
        return out

    def __str__(self) -> str:
        return self.value


POLICIES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)     # least recomputation first

StageRecompute = tuple[tuple[Recompute, ...], ...]      # per pipeline, per stage


def parse_stage_recompute(data: Any, stages_per_pipeline: Sequence[int], where: str) -> StageRecompute:
    """Per-stage policies from a layout file's ``recompute`` field: one list per pipeline, one policy per stage."""
    if not isinstance(data, (list, tuple)) or len(data) != len(stages_per_pipeline):
        raise ConfigError(f"{where}: recompute={data!r} must list, per pipeline ({len(stages_per_pipeline)}), "
                          "one policy per stage (none, selective or full)")
    out = []
    for p, (row, n) in enumerate(zip(data, stages_per_pipeline)):
        if not isinstance(row, (list, tuple)) or len(row) != n:
            raise ConfigError(f"{where}: recompute[{p}]={row!r} must give one policy per stage ({n})")
        out.append(tuple(Recompute.policy(v, f"{where}: recompute[{p}]") for v in row))
    return tuple(out)


def uniform(policy: Recompute, stages_per_pipeline: Sequence[int]) -> StageRecompute:
    """One policy on every stage."""
    policy = Recompute.policy(policy)
    return tuple((policy,) * n for n in stages_per_pipeline)


def resolve(request: Any, stages_per_pipeline: Sequence[int], filed: StageRecompute = ()) -> StageRecompute:
    """Every stage's policy from a run's request: one policy (``auto``: the layout file's per-stage ``filed``
    policies where it has them, else ``none``), or per pipeline one policy per stage."""
    if isinstance(request, (list, tuple)):
        return parse_stage_recompute(request, stages_per_pipeline, "recompute")
    request = Recompute.parse(request)
    if request is Recompute.AUTO:
        return filed if filed else uniform(Recompute.NONE, stages_per_pipeline)
    return uniform(request, stages_per_pipeline)
