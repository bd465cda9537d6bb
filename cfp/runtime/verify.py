"""Single-device replay of a training run and the comparison behind ``cfp train --verify``.

The reference is ``cfp.models.train_step(...).step`` (one ``value_and_grad`` of the model's loss on the
concatenated global batch + AdamW) jitted on one device, started from the same state.

Relative error: for losses ``|a - b| / |b|``; for parameters the normwise ``||a - b||_2 / ||b||_2``
over all parameters (``tree_error``), or per leaf (``leaf_error``).  Elementwise comparison of
parameters after AdamW steps is not meaningful in f32: Adam divides each gradient by its running RMS,
so an element whose gradient is a near-cancelling sum (rounding noise a sizeable fraction of its
value) moves by a visibly different amount when the reduction order changes (micro-batching, TP
all-reduces, summing pipelines) although the gradient as a whole matches to ~1e-7.  Per leaf this
even holds for whole leaves whose exact gradient is zero, e.g. attention key biases (softmax ignores a
per-row constant): both runs move them by +-lr per step driven by rounding noise alone, so the verify
figure is the global normwise error.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import jax
import numpy as np

from cfp.models import train_step


def replay(model_name: str, config: Any, params: Any, opt_state: Any, batches: Iterable[dict], *,
           learning_rate: float, weight_decay: float, device: Optional[Any] = None):
    """Run the reference steps on one device; returns (losses, final params as numpy)."""
    device = device if device is not None else jax.local_devices()[0]
    ts = train_step(model_name, config, learning_rate=learning_rate, weight_decay=weight_decay)
    step = jax.jit(ts.step)
    p, o = jax.device_put((params, opt_state), device)
    losses = []
    for b in batches:
        p, o, loss = step(p, o, jax.device_put(b, device))
        losses.append(float(loss))
    return losses, jax.tree_util.tree_map(np.asarray, jax.device_get(p))


def loss_error(losses: list[float], ref: list[float]) -> float:
    return max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref)), default=0.0)


def tree_error(tree: Any, ref: Any) -> float:
    """Normwise relative error ``||a - b|| / ||b||`` over all leaves together."""
    diff = sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
               for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(ref)))
    norm = sum(float(np.sum(np.asarray(b, np.float64) ** 2)) for b in jax.tree_util.tree_leaves(ref))
    return float(np.sqrt(diff) / max(np.sqrt(norm), 1e-30))


def leaf_error(tree: Any, ref: Any) -> float:
    """Largest per-leaf normwise relative error ``||a - b|| / ||b||``."""
    errs = jax.tree_util.tree_map(
        lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                           / max(float(np.linalg.norm(np.asarray(b, np.float64))), 1e-30)), tree, ref)
    return max(jax.tree_util.tree_leaves(errs), default=0.0)


def identical_across_pipelines(trainer) -> bool:
    """Whether every pipeline holds bit-identical values of every module it holds (local stages)."""
    seen: dict[str, np.ndarray] = {}
    for key in sorted(trainer.params):
        for path, v in jax.tree_util.tree_flatten_with_path(trainer.params[key])[0]:
            k, a = jax.tree_util.keystr(path), np.asarray(v)
            if k in seen and not np.array_equal(seen[k], a):
                return False
            seen.setdefault(k, a)
    return True
