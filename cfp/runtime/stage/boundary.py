"""The boundary transfer a stage's activation layouts imply, priced from the one cost floor
(`cfp.costs.ModelCost`): the search adds it to every candidate's step time, and to Megatron's."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from jax.sharding import PartitionSpec as P

from cfp.costs import ModelCost

if TYPE_CHECKING:
    from cfp.runtime.stage.cases import StageCase


def _shards(spec: P, mesh_shape: dict) -> int:
    axes = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    return math.prod(mesh_shape[a] for a in axes)


def boundary_seconds(case: StageCase, act_in: P, act_out: P, link_gbps: float) -> float:
    """Seconds per micro-batch to bring the stage its input activation and its output's gradient: every
    device of the stage receives its shard (a replicated layout costs a full copy per device). Bytes per
    sequence are `ModelCost`'s (token ids into the first stage, `boundary_bytes` between stages)."""
    cost = ModelCost(case.config)
    shape = dict(case.prog.mesh.shape)
    per_device = case.micro_batch * case.prog.mesh.devices.size
    st = case.prog.stage
    total = per_device * (cost.token_bytes() if st.is_first else cost.boundary_bytes()) / _shards(act_in, shape)
    if not st.is_last:
        total += per_device * cost.boundary_bytes() / _shards(act_out, shape)
    return total / (link_gbps * 1e9)
