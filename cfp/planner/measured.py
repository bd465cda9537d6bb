"""Measured stage times for the planner's cost model, where a training run has measured them.

`cfp train --stage-plans search` times every searched stage's runtime programs (forward and backward of each
micro-batch, then the update) side by side with its Megatron sharding, and saves the times with the stage
plans. A stage of the same shape — model config, TP degree, layer count, first/last, micro-batch size — on the
same kind of device costs the same, so `cfp plan --stage-times DIR` prices such stages by the measured time
instead of the analytic one; every other stage stays estimated, and the table says which is which.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from cfp.errors import ConfigError


@dataclass(frozen=True)
class StageShape:
    """What a stage's time per micro-batch depends on, apart from the model config and the device."""
    tp: int
    layers: int
    first: bool
    last: bool
    micro_batch: int


@dataclass(frozen=True)
class MeasuredStageTimes:
    """Seconds per micro-batch (forward + backward, the update's share included) of stages measured on
    `device` (a GPU-catalog name; "cpu" for this machine's devices) for the model config `config`."""
    device: str
    config: tuple[tuple[str, Any], ...]
    times: tuple[tuple[StageShape, float], ...]
    source: str = ""

    def __post_init__(self):
        for shape, t in self.times:
            if not (isinstance(t, (int, float)) and t > 0 and t < float("inf")):
                raise ConfigError(f"measured stage time {t!r} for {shape} in {self.source or 'stage times'} "
                                  "must be a positive, finite number of seconds")

    def check_config(self, config: Any) -> "MeasuredStageTimes":
        """Raise ConfigError unless the times were measured for `config` (a model config dataclass)."""
        mine = dict(self.config)
        theirs = _config_items(config)
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if diff:
            k = diff[0]
            raise ConfigError(f"stage times in {self.source or 'the given directory'} were measured for another "
                              f"model config ({k}={mine.get(k)!r}, planning {k}={theirs.get(k)!r}); measure this "
                              "config with `cfp train --stage-plans search` or plan without --stage-times")
        return self

    def lookup(self, device: str, shape: StageShape) -> Optional[float]:
        """The measured seconds per micro-batch of a stage of `shape` on `device`, or None."""
        if device.lower() != self.device.lower():
            return None
        return dict(self.times).get(shape)


def _config_items(config: Any) -> dict:
    return {k: _hashable(v) for k, v in dataclasses.asdict(config).items()}


def _hashable(v):
    return tuple(_hashable(x) for x in v) if isinstance(v, (list, tuple)) else v


def measured_stage_times(device: str, config: dict, stages, source: str = "") -> MeasuredStageTimes:
    """From (StageShape, seconds) pairs; pairs of one shape keep the fastest (a stage that ran faster once
    can run that fast)."""
    best: dict[StageShape, float] = {}
    for shape, t in stages:
        best[shape] = min(t, best.get(shape, t))
    cfg = tuple(sorted((k, _hashable(v)) for k, v in config.items()))
    return MeasuredStageTimes(device, cfg, tuple(sorted(best.items(), key=lambda kv: dataclasses.astuple(kv[0]))),
                              source)
