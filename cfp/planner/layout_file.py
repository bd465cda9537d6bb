"""The layout file `cfp plan` writes and `cfp train --layout FILE` runs: JSON with the runtime's fields
(the same as the train flags), the model it is for, the estimate and the cluster it was planned for."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from cfp.errors import ConfigError
from cfp.files import write_text_atomic
from cfp.models import get_config
from cfp.runtime.layout import HeteroLayout
from cfp.runtime.schedules import ScheduleName

FORMAT = "cfp-layout/1"
LIST_FIELDS = ("hetero_configs", "layer_partitions", "global_batch_size", "chunks", "devices_id")
# train flags a layout file sets (its model fields and its runtime fields)
TRAIN_FIELDS = ("model", "config", "num_layers", "seq_len", "dtype", "schedule") + LIST_FIELDS


@dataclass(frozen=True)
class LayoutFile:
    model: str
    config: str
    overrides: Mapping[str, Any]
    schedule: ScheduleName
    fields: Mapping[str, Any]       # the runtime's lists
    estimate: Mapping[str, Any]
    cluster: Mapping[str, Any]

    def hetero_layout(self) -> HeteroLayout:
        return HeteroLayout.from_lists(**self.fields)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "model": self.model, "config": self.config,
                "overrides": dict(self.overrides), "schedule": self.schedule.value,
                **{k: self.fields[k] for k in LIST_FIELDS},
                "estimate": dict(self.estimate), "cluster": dict(self.cluster)}


def write_layout_file(path: str, layout_file: LayoutFile) -> None:
    """Write atomically (a temporary file in the same directory, then rename)."""
    write_text_atomic(path, json.dumps(layout_file.to_dict(), indent=1) + "\n")


def parse_layout_file(data: Any, where: str = "layout file") -> LayoutFile:
    """Validate a loaded layout document: its model config exists and the layout fits it."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ConfigError(f"{where}: not a cfp layout file (expected \"format\": \"{FORMAT}\")")
    for key in ("model", "config", "schedule") + LIST_FIELDS:
        if key not in data:
            raise ConfigError(f"{where}: missing field {key!r}")
    overrides = data.get("overrides", {})
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{where}: overrides={overrides!r} must be a mapping")
    config = get_config(data["model"], data["config"], **overrides)
    fields = {k: data[k] for k in LIST_FIELDS}
    out = LayoutFile(data["model"], data["config"], dict(overrides), ScheduleName.parse(data["schedule"]),
                     fields, data.get("estimate", {}), data.get("cluster", {}))
    out.hetero_layout().validate_for(config)
    return out


def load_layout_file(path: str) -> LayoutFile:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read layout file {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"layout file {path!r} is not JSON: {e}") from None
    return parse_layout_file(data, f"layout file {path!r}")


def train_args_from_layout(args: Any) -> dict[str, Any]:
    """Values for `cfp train`'s arguments: from `args.layout` when given (a flag set as well is an
    error unless it agrees), else none, after checking that the layout flags were given."""
    if not getattr(args, "layout", None):
        missing = [f"--{n.replace('_', '-')}" for n in ("model", "hetero_configs") if getattr(args, n) is None]
        if missing:
            raise ConfigError(f"{' and '.join(missing)} required unless --layout FILE is given")
        return {}
    lf = load_layout_file(args.layout)
    values = {"model": lf.model, "config": lf.config, "schedule": lf.schedule.value,
              "num_layers": lf.overrides.get("num_layers"), "seq_len": lf.overrides.get("seq_len"),
              "dtype": lf.overrides.get("dtype"),
              **{k: json.dumps(v) if k in ("hetero_configs", "layer_partitions", "devices_id") else v
                 for k, v in lf.fields.items()}}
    for name in ("model", "hetero_configs", "layer_partitions", "devices_id", "num_layers", "seq_len", "dtype"):
        given = getattr(args, name, None)
        if given is not None and str(given) != str(values[name]):
            raise ConfigError(f"--{name.replace('_', '-')}={given} conflicts with layout file {args.layout!r} "
                              f"({values[name]}); drop the flag or the file")
    return values
