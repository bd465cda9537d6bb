"""The layered parameter tree: its parts, each leaf's unit, and what a stage holds."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import numpy as np

from cfp.errors import ConfigError


class Part(enum.Enum):
    """The three parts of a layered model's parameter tree."""

    FIRST = "first"
    LAYERS = "layers"
    LAST = "last"


@dataclasses.dataclass(frozen=True)
class Unit:
    """Where a parameter leaf lives: "first", "last", list layer ``layer``, or (``layer`` None) the stacked
    layers."""

    part: Part
    layer: int | None = None

    @property
    def stacked(self) -> bool:
        return self.part is Part.LAYERS and self.layer is None


STACKED = Unit(Part.LAYERS)


@dataclasses.dataclass(frozen=True)
class StageHolding:
    """What one stage holds: "first" or not, layers ``[start, stop)``, "last" or not."""

    first: bool
    start: int
    stop: int
    last: bool

    def __post_init__(self):
        if not 0 <= self.start <= self.stop:
            raise ConfigError(f"stage layers [{self.start}, {self.stop}) must satisfy 0 <= start <= stop")

    @property
    def rows(self) -> tuple[int, int]:
        return self.start, self.stop

    def holds(self, unit: Unit | None) -> bool:
        """Whether the stage holds ``unit``'s values (None: replicated, every stage does)."""
        if unit is None:
            return True
        if unit.part is Part.FIRST:
            return self.first
        if unit.part is Part.LAST:
            return self.last
        if unit.layer is None:
            return self.stop > self.start
        return self.start <= unit.layer < self.stop


@dataclasses.dataclass(frozen=True)
class Leaves:
    """The flattened parameter tree: each leaf's name and unit."""

    keys: tuple[str, ...]        # keystr of each leaf's path in the whole tree
    units: tuple[Unit, ...]
    likes: tuple                 # ShapeDtypeStruct of each leaf
    treedef: Any
    layers: int                  # L
    listed: bool                 # the list form (else stacked)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple("params" + k for k in self.keys)

    def describe(self, leaves) -> str:
        names = [self.names[i] for i in sorted(leaves)]
        more = f" (and {len(names) - 2} more)" if len(names) > 2 else ""
        return (", ".join(names[:2]) + more) if names else "no parameter"


def leaf_table(params_like: Any) -> Leaves:
    """Validate the layered parameter tree and give every leaf its unit."""
    if not isinstance(params_like, dict) or set(params_like) != {p.value for p in Part}:
        got = sorted(params_like) if isinstance(params_like, dict) else type(params_like).__name__
        raise ConfigError(f"layered parameters must be a dict with keys first, layers, last; got {got}")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params_like)
    layers = params_like["layers"]
    listed = isinstance(layers, (list, tuple))
    sizes = {tuple(np.shape(x))[:1] for x in jax.tree_util.tree_leaves(layers)}
    if not listed and (len(sizes) != 1 or min(sizes) in ((), (0,))):
        raise ConfigError(f"stacked layers must all have one leading layer dim of size >= 1; leading sizes of "
                          f"their leaves: {sorted(sizes)}")
    count = len(layers) if listed else sizes.pop()[0]
    units = tuple(Unit(Part(path[0].key), path[1].idx if path[0].key == "layers" and listed else None)
                  for path, _ in flat)
    return Leaves(tuple(jax.tree_util.keystr(path) for path, _ in flat), units, tuple(x for _, x in flat),
                   treedef, count, listed)
