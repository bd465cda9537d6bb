"""Activations between stages as pytrees: their floating leaves carry gradients, their integer leaves (segment
ids, positions, masks) travel forward only.

An activation's gradient is the flat list of its floating leaves' cotangents, in `tree_leaves` order: what the
next stage's backward returns and the previous stage's backward takes.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def differentiable(leaf: Any) -> bool:
    """Whether a leaf (array or ShapeDtypeStruct) carries a gradient: a floating (or complex) dtype."""
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


def split(tree: Any) -> tuple[list, list, Any]:
    """``(differentiable leaves, the other leaves, how to rejoin them)``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mask = tuple(differentiable(a) for a in leaves)
    return ([a for a, m in zip(leaves, mask) if m], [a for a, m in zip(leaves, mask) if not m], (treedef, mask))


def join(floats: list, others: list, how: Any) -> Any:
    """The tree `split` took apart."""
    treedef, mask = how
    fi, oi = iter(floats), iter(others)
    return jax.tree_util.tree_unflatten(treedef, [next(fi) if m else next(oi) for m in mask])


def cotangent(like: Any, grads: list) -> Any:
    """A cotangent tree for an output shaped like ``like``: ``grads`` for its differentiable leaves (in order),
    float0 zeros (JAX's cotangent of an integer value) for the others."""
    gi = iter(grads)
    leaves, treedef = jax.tree_util.tree_flatten(like)
    return jax.tree_util.tree_unflatten(treedef, [
        next(gi) if differentiable(a) else np.zeros(a.shape, jax.dtypes.float0) for a in leaves])


def gradient_like(like: Any) -> list:
    """ShapeDtypeStructs of an activation's gradient (its differentiable leaves)."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(like) if differentiable(a)]
