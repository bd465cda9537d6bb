"""The boundary transfer a stage's activation layouts imply: the search adds it to every candidate's step time,
and to the rules table's."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from cfp.runtime.stage import activations

if TYPE_CHECKING:
    from cfp.runtime.stage.cases import StageCase


def _shards(spec: P, mesh_shape: dict) -> int:
    axes = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    return math.prod(mesh_shape[a] for a in axes)


def _bytes(leaves: Sequence, specs: Sequence[P], mesh_shape: dict) -> float:
    return float(sum(math.prod(l.shape) * np.dtype(l.dtype).itemsize / _shards(s, mesh_shape)
                     for l, s in zip(leaves, specs)))


def boundary_seconds(case: "StageCase", act_in: Sequence[P], act_out: Sequence[P], link_gbps: float) -> float:
    """Seconds per micro-batch to bring the stage its input (the micro-batch on the first stage, else the previous
    stage's activation; one layout per leaf in `act_in`) and its output's gradient (one layout per differentiable
    leaf in `act_out`): every device of the stage receives its shard (a replicated layout costs a full copy per
    device)."""
    shape = dict(case.prog.mesh.shape)
    n = case.prog.mesh.devices.size
    incoming = case.batch_like if case.prog.stage.is_first else case.x_like
    total = n * _bytes(jax.tree_util.tree_leaves(incoming), act_in, shape)
    if case.y_like is not None:
        total += n * _bytes(activations.gradient_like(case.y_like), act_out, shape)
    return total / (link_gbps * 1e9)


def replicated(case: "StageCase") -> tuple[list[P], list[P]]:
    """The rules table's boundary layouts: every incoming leaf and outgoing gradient replicated."""
    incoming = case.batch_like if case.prog.stage.is_first else case.x_like
    out = activations.gradient_like(case.y_like) if case.y_like is not None else []
    return [P()] * len(jax.tree_util.tree_leaves(incoming)), [P()] * len(out)
