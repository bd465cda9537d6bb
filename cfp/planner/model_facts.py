"""Planning any `LayeredModel` for a mixed cluster: its cost facts derived from its own traced and compiled parts
(`cfp.layered.derive`), then the same planner and cost model as the zoo's."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Union

from cfp.errors import ConfigError
from cfp.layered.derive import FactsOptions, derive_facts
from cfp.layered.facts import CostFacts
from cfp.layered.model import LayeredModel
from cfp.planner.cluster import Cluster, as_cluster
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import PlannerResult, find_layout


def facts_for(model: Union[LayeredModel, CostFacts], cluster: Cluster, example_batch: Any, optimizer: Any = None,
              tokens_per_row: int = 1) -> CostFacts:
    """`model`'s cost facts at the TP degrees `cluster`'s machines allow (given facts are returned as they are)."""
    if isinstance(model, CostFacts):
        return model
    if not isinstance(model, LayeredModel):
        raise ConfigError(f"plan_layout needs a cfp.LayeredModel (or its CostFacts), got {type(model).__name__}")
    if example_batch is None:
        raise ConfigError("plan_layout needs example_batch=: a micro-batch the model runs on (its cost facts are "
                          "traced and compiled on it)")
    top = max(m.count for m in cluster.machines)
    tps = tuple(range(1, top + 1))
    return derive_facts(model, example_batch, optimizer=optimizer,
                        options=FactsOptions(tokens_per_row=tokens_per_row, tp_degrees=tps))


def plan_layout(model: Union[LayeredModel, CostFacts], cluster: Union[Cluster, Mapping, str], *, global_batch: int,
                example_batch: Any = None, optimizer: Any = None, options: Optional[PlannerOptions] = None,
                tokens_per_row: int = 1, progress: Optional[Callable[[int, int], None]] = None) -> PlannerResult:
    """The best heterogeneous layout for `model` on `cluster` (a `Cluster`, a cluster file's path or its parsed
    mapping) at `global_batch` rows per step: pipelines, their stages' devices, TP degrees and layer counts, and batch
    splits, priced by the model's own cost facts (derived on `example_batch`, one micro-batch, with
    `optimizer`'s state; None: AdamW's). `options`: the planner's other options (their global batch is
    replaced by `global_batch`); `tokens_per_row`: for the estimate's tokens/s (1: rows/s)."""
    cluster = as_cluster(cluster)
    if options is not None and not isinstance(options, PlannerOptions):
        raise ConfigError(f"options={options!r} must be a cfp.PlannerOptions")
    opts = (PlannerOptions(global_batch_size=global_batch) if options is None
            else dataclasses.replace(options, global_batch_size=global_batch))
    facts = facts_for(model, cluster, example_batch, optimizer, tokens_per_row)
    return find_layout(cluster, facts, opts, progress)
