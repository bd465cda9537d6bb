"""The layout file `cfp plan` writes and `cfp train --layout FILE` runs: JSON holding the planned
`cfp.layout.Layout` (its `to_json`), the model it is for, the schedule, the estimate and the cluster it was
planned for. Loading validates every field and builds the `Layout` the runtime takes as is."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from cfp.errors import ConfigError
from cfp.files import write_text_atomic
from cfp.layout import Layout
from cfp.models import get_config
from cfp.recompute import StageRecompute, parse_stage_recompute
from cfp.schedules.registry import ScheduleName, ScheduleSpec

FORMAT = "cfp-layout/2"     # 2: the layout is `Layout.to_json`; 1 had the seed's five list fields
OLD_FORMATS = ("cfp-layout/1",)


def is_factory(model: str) -> bool:
    """Whether a layout file's model is a user's factory (``module:factory`` / ``file.py:factory``), not a zoo name."""
    return ":" in model


@dataclass(frozen=True)
class LayoutFile:
    """A planned layout: ``model`` a zoo name (with ``config`` and ``overrides``) or a user's factory spec (``config``
    empty)."""
    model: str
    config: str
    overrides: Mapping[str, Any]
    schedule: ScheduleName
    layout: Layout
    estimate: Mapping[str, Any]
    cluster: Mapping[str, Any]
    schedules: tuple[str, ...] = ()     # per pipeline, the schedule `cfp plan` priced it with (empty: `schedule`)
    recompute: StageRecompute = ()      # per pipeline, per stage, the recompute policy (empty: the run's option)

    def to_dict(self) -> dict:
        out = {"format": FORMAT, "model": self.model, "config": self.config,
               "overrides": dict(self.overrides), "schedule": self.schedule.value,
               "layout": self.layout.to_json(), "estimate": dict(self.estimate), "cluster": dict(self.cluster)}
        if self.schedules:
            out["schedules"] = list(self.schedules)
        if self.recompute:
            out["recompute"] = [[p.value for p in row] for row in self.recompute]
        return out


def write_layout_file(path: str, layout_file: LayoutFile) -> None:
    """Write atomically (a temporary file in the same directory, then rename)."""
    write_text_atomic(path, json.dumps(layout_file.to_dict(), indent=1) + "\n")


def parse_layout_file(data: Any, where: str = "layout file") -> LayoutFile:
    """Validate a loaded layout document: its fields, its model config, and that the layout fits it."""
    fmt = data.get("format") if isinstance(data, Mapping) else None
    if fmt in OLD_FORMATS:
        raise ConfigError(f"{where} has the older format {fmt!r} (written by an older cfp); regenerate it "
                          f"with this cfp: `cfp plan --cluster CLUSTER --model MODEL ... --out FILE`")
    if fmt != FORMAT:
        raise ConfigError(f"{where}: not a cfp layout file (expected \"format\": \"{FORMAT}\")")
    for key, kind in (("model", str), ("config", str), ("schedule", str), ("layout", Mapping)):
        if key not in data:
            raise ConfigError(f"{where}: missing field {key!r}")
        if not isinstance(data[key], kind):
            raise ConfigError(f"{where}: {key}={data[key]!r} must be a {'mapping' if kind is Mapping else 'string'}")
    for key in ("overrides", "estimate", "cluster"):
        if not isinstance(data.get(key, {}), Mapping):
            raise ConfigError(f"{where}: {key}={data[key]!r} must be a mapping")
    overrides = dict(data.get("overrides", {}))
    factory = is_factory(data["model"])     # a user's model: checked against the layout when it is loaded
    try:
        config = None if factory else get_config(data["model"], data["config"], **overrides)
        schedule = ScheduleName.parse(data["schedule"])
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    layout = Layout.from_json(data["layout"], f"{where}: layout")
    try:
        if config is not None:
            layout.validate_for(config.num_layers, heads=(config.num_heads, config.num_heads))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    schedules = data.get("schedules", [])
    if not isinstance(schedules, list) or (schedules and len(schedules) != len(layout.pipelines)):
        raise ConfigError(f"{where}: schedules={schedules!r} must list one schedule per pipeline "
                          f"({len(layout.pipelines)})")
    try:
        schedules = tuple(str(ScheduleSpec.parse(s)) for s in schedules)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    recompute = data.get("recompute", [])
    recompute = parse_stage_recompute(recompute, [p.num_stages for p in layout.pipelines], where) if recompute else ()
    return LayoutFile(model=data["model"], config=data["config"], overrides=overrides, schedule=schedule,
                      layout=layout, estimate=dict(data.get("estimate", {})), cluster=dict(data.get("cluster", {})),
                      schedules=schedules, recompute=recompute)


def load_layout_file(path: str) -> LayoutFile:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read layout file {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"layout file {path!r} is not JSON: {e}") from None
    return parse_layout_file(data, f"layout file {path!r}")
