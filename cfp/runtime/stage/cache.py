"""The one compile cache of a training run: stage programs, analysed stage steps and replays, each built once.

The engine owns one (`HeteroTrainer.cache`) and the stage-plan search is handed the same one, so the programs
the search built and timed are the ones that train: nothing is rebuilt (or recompiled) between the search and
the first step, a strategy switched back to reuses its compiled programs, and two runs that should not share
compiled code (another optimizer, another process) simply hold two caches. It is bound to one model and one optimizer:
every program in it runs that model and updates with `tx`.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import optax

from cfp.layout import PlacedStage
from cfp.recompute import Recompute

if TYPE_CHECKING:
    from cfp.layered.model import LayeredModel

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StepKey:
    """What a stage's analysed step depends on (the cache's model and optimizer aside): its layers, TP degree,
    micro-batch and ends (the devices do not matter: an analysis is mesh-shape only)."""
    layers: tuple[int, int]
    tp: int
    micro_batch: int
    is_first: bool
    is_last: bool

    @classmethod
    def of(cls, st: PlacedStage, micro_batch: int) -> "StepKey":
        return cls((st.layer_start, st.layer_end), st.tp, micro_batch, st.is_first, st.is_last)


PlanChoice = Optional[tuple[tuple[int, ...], tuple[int, ...]]]   # (choice, shard_state); None: the rules table


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """What a stage's programs depend on (the cache's model and optimizer aside): the stage, its devices and its
    sharding (the rules table, or a searched plan's choice)."""
    stage: PlacedStage
    devices: tuple
    plan: PlanChoice = None
    recompute: Recompute = Recompute.NONE


class Built(enum.Enum):
    PROGRAM = "stage program"        # a `StageProgram` (its jitted programs compile on first use)
    STEP = "analysed stage step"     # (analysis, program, example arguments) of a stage's `stage_step`
    REPLAY = "stage replay"          # a `StageReplay`: a searched plan's programs cut from the analysed step


class CompileCache:
    """Stage programs, analysed stage steps and replays of one model and optimizer, by key; `builds` counts what
    was built (`Built` -> count), so a caller can see that nothing was built twice."""

    def __init__(self, model: "LayeredModel", tx: optax.GradientTransformation):
        from cfp.runtime.stage.optim import ModelOptimizer
        self.model, self.tx = model, tx
        self.optimizer = ModelOptimizer(tx, model)      # the optimizer's split by stage (checked once here)
        self._entries: dict[tuple[Built, Any], Any] = {}
        self.builds: Counter = Counter()

    def get(self, kind: Built, key: Any, build: Callable[[], T]) -> T:
        """The cached `kind` entry of `key`, built with `build()` the first time."""
        if (kind, key) not in self._entries:
            self._entries[(kind, key)] = build()
            self.builds[kind] += 1
        return self._entries[(kind, key)]

    def put(self, kind: Built, key: Any, value: Any) -> None:
        """Keep `value` (built elsewhere, e.g. by the search) unless `key` already has one."""
        if (kind, key) not in self._entries:
            self._entries[(kind, key)] = value
            self.builds[kind] += 1

    def find(self, kind: Built, key: Any) -> Any:
        """The cached entry or None."""
        return self._entries.get((kind, key))
