"""A user's model as the runtime trains it (`train_pipelines`, `cfp train --model module:factory`): the model,
step -> global batch and the optimizer."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from cfp.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class UserModel:
    """What a factory returned, checked: the model, step -> global batch, the optimizer and where it came from."""
    model: Any
    batches: Callable[[int, int], Any]
    optimizer: Any
    spec: str


def cycled_rows(batch: Any) -> Callable[[int, int], Any]:
    """``(step, rows) -> batch``: step ``s`` takes rows ``s*rows ..`` of ``batch``, wrapping around."""
    import jax
    host = jax.tree_util.tree_map(np.asarray, batch)
    leaves = jax.tree_util.tree_leaves(host)
    if not leaves or any(np.ndim(a) == 0 for a in leaves) or len({a.shape[0] for a in leaves}) != 1:
        raise ConfigError("the factory's batch must be a pytree of arrays sharing a leading batch dim")
    n = leaves[0].shape[0]

    def batches(step: int, rows: int) -> Any:
        idx = (np.arange(rows) + step * rows) % n
        return jax.tree_util.tree_map(lambda a: a[idx], host)
    return batches
