"""A layered model's cost facts: what the planner prices, derived from the model itself (`derive_facts` in
`cfp.layered.derive`), frozen and JSON-serialisable, read through the `cfp.costs.ModelFigures` interface that
the zoo's hand-written `ModelCost` implements too (so either prices a layout through one path).

Per part (`first`, each kind of layer with its share of the layers, `last`) and per tensor-parallel degree, per
device and per row of a micro-batch: the forward's dots as GEMMs, its FLOPs and memory-bound bytes, the
backward's FLOPs, the activations kept for the backward and the backward's transients, the parameters and the
optimizer state, and the activation all-reduces. How each figure is derived: `cfp.layered.derive`.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional

from cfp.costs import Gemm, Part
from cfp.errors import ConfigError

FORMAT = "cfp-cost-facts/1"


@dataclasses.dataclass(frozen=True)
class GemmFact:
    """One forward dot at one TP degree, per device: `flops` per row (per call when `scale` is None) and its
    GEMM shape (m, n, k) at one row; `scale` is the loop that grows with the rows: "m", "n", "k", "b" (the
    batch loop: the FLOPs grow, the shape does not) or None."""
    flops: float
    shape: tuple[float, float, float]
    scale: Optional[str]

    def at(self, mb: int, weight: float = 1.0) -> Gemm:
        if self.scale is None:
            return self.flops * weight, self.shape
        shape = tuple(d * mb if "mnk"[i] == self.scale else d for i, d in enumerate(self.shape))
        return self.flops * mb * weight, shape


@dataclasses.dataclass(frozen=True)
class PartFacts:
    """One part at one TP degree, per device, per row unless said otherwise (see `cfp.layered.derive`)."""
    gemms: tuple[GemmFact, ...]
    flops: float                # forward: dots and elementwise
    backward_flops: float       # the gradients, without a recomputed forward
    elementwise_bytes: float    # forward memory-bound bytes read + written
    score_bytes: float          # the softmax passes among them
    backward_bytes: float       # per micro-batch: the backward's memory-bound bytes that do not grow with rows
    backward_row_bytes: float   # the backward's that do, beyond the recomputed forward's
    activation_bytes: float     # kept for the backward
    temp_bytes: float           # transients of the backward beyond them (per micro-batch row)
    params: float               # elements
    param_bytes: float
    optimizer_bytes: float
    all_reduces: float          # forward activation all-reduces, in activations of `boundary_bytes`

    @property
    def dot_flops(self) -> float:
        """Forward dot FLOPs of one row (dots that do not grow with the rows left out)."""
        return sum(g.flops for g in self.gemms if g.scale is not None)


@dataclasses.dataclass(frozen=True)
class PartTable:
    """A part's facts at each TP degree derived; `share`: its layers' share of the model's (layer kinds)."""
    by_tp: tuple[tuple[int, PartFacts], ...]
    share: float = 1.0

    def at(self, tp: int, name: str) -> PartFacts:
        for t, f in self.by_tp:
            if t == tp:
                return f
        raise ConfigError(f"cost facts of {name!r} have no tensor-parallel degree {tp}; derived: "
                          f"{', '.join(str(t) for t, _ in self.by_tp)}")


def _weighted(values) -> float:
    return float(sum(values))


@dataclasses.dataclass(frozen=True)
class CostFacts:
    """A layered model's cost facts (module doc): `ModelFigures` for the planner. Build with
    `cfp.layered.derive.derive_facts`; `to_json` / `from_json` round-trip them."""
    name: str
    num_layers: int
    seq_len: int                 # tokens per row
    dtype: str
    tp_divisor: int
    act_itemsize: int
    boundary: float              # bytes per row sent between stages
    tokens: float                # bytes per row of the batch the first stage reads
    first: PartTable
    kinds: tuple[PartTable, ...]
    last: PartTable
    backend: str = ""            # the device kind the parts were compiled for

    def __post_init__(self):
        if abs(sum(k.share for k in self.kinds) - 1.0) > 1e-9:
            raise ConfigError(f"cost facts of {self.name!r}: layer kind shares "
                              f"{[k.share for k in self.kinds]} do not sum to 1")

    # -- the model
    @property
    def act_bytes(self) -> int:
        return self.act_itemsize

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(t for t, _ in self.first.by_tp)

    def _layer(self, tp: int, field: str) -> float:
        return _weighted(getattr(k.at(tp, self.name), field) * k.share for k in self.kinds)

    def _part(self, part: Part) -> PartTable:
        return {Part.EMBED: self.first, Part.HEAD: self.last}[part]

    # -- dots
    def layer_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]:
        return tuple(g.at(mb, k.share) for k in self.kinds for g in k.at(tp, self.name).gemms)

    def head_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]:
        return tuple(g.at(mb) for g in self.last.at(tp, self.name).gemms)

    def embed_gemms(self, tp: int, mb: int) -> tuple[Gemm, ...]:
        return tuple(g.at(mb) for g in self.first.at(tp, self.name).gemms)

    def layer_dot_flops(self, tp: int = 1) -> float:
        return self._layer(tp, "dot_flops")

    def head_dot_flops(self, tp: int = 1) -> float:
        return self.last.at(tp, self.name).dot_flops

    def model_flops_per_sequence(self) -> float:
        """Dot FLOPs of forward + backward of one row without recomputation (3x the forward's)."""
        return 3 * (self.num_layers * self.layer_dot_flops(1) + self.head_dot_flops(1)
                    + self.first.at(1, self.name).dot_flops)

    def layer_flops(self, tp: int = 1) -> float:
        return self._layer(tp, "flops")

    def head_flops(self, tp: int = 1) -> float:
        return self.last.at(tp, self.name).flops

    def layer_backward_flops(self, tp: int = 1) -> float:
        return self._layer(tp, "backward_flops")

    def head_backward_flops(self, tp: int = 1) -> float:
        return self.last.at(tp, self.name).backward_flops

    # -- memory-bound work
    def layer_elementwise_bytes(self, tp: int = 1) -> float:
        return self._layer(tp, "elementwise_bytes")

    def layer_score_bytes(self, tp: int = 1) -> float:
        return self._layer(tp, "score_bytes")

    def head_elementwise_bytes(self, tp: int = 1) -> float:
        return self.last.at(tp, self.name).elementwise_bytes

    def head_score_bytes(self, tp: int = 1) -> float:
        return self.last.at(tp, self.name).score_bytes

    def embed_elementwise_bytes(self, tp: int = 1) -> tuple[float, float, float]:
        f = self.first.at(tp, self.name)
        return f.elementwise_bytes, f.backward_bytes, f.backward_row_bytes

    # -- parameters and state
    def layer_params(self, tp: int = 1) -> float:
        return self._layer(tp, "params")

    def embed_params(self, tp: int = 1) -> float:
        return self.first.at(tp, self.name).params

    def head_params(self, tp: int = 1) -> float:
        return self.last.at(tp, self.name).params

    def param_bytes(self, part: Part, tp: int = 1) -> float:
        part = Part(part)
        if part is Part.LAYER:
            return self._layer(tp, "param_bytes")
        return self._part(part).at(tp, self.name).param_bytes

    def optimizer_bytes(self, part: Part, tp: int = 1) -> float:
        part = Part(part)
        if part is Part.LAYER:
            return self._layer(tp, "optimizer_bytes")
        return self._part(part).at(tp, self.name).optimizer_bytes

    # -- activations
    def layer_activation_bytes(self, tp: int = 1) -> float:
        return self._layer(tp, "activation_bytes")

    def layer_temp_bytes(self, tp: int = 1) -> float:
        return max(k.at(tp, self.name).temp_bytes for k in self.kinds)

    def head_activation_bytes(self, tp: int = 1) -> float:
        f = self.last.at(tp, self.name)
        return f.activation_bytes + f.temp_bytes

    def embed_backward_bytes(self, tp: int = 1) -> float:
        return self.first.at(tp, self.name).temp_bytes

    def boundary_bytes(self) -> float:
        return self.boundary

    def token_bytes(self) -> float:
        return self.tokens

    def layer_all_reduces(self, tp: int = 2) -> float:
        return self._layer(tp, "all_reduces") if tp > 1 else 0.0

    # -- JSON
    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    def save(self, path: str) -> None:
        from cfp.files import write_text_atomic
        write_text_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: Any, where: str = "cost facts") -> "CostFacts":
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ConfigError(f"{where}: not cfp cost facts (expected \"format\": \"{FORMAT}\")")
        try:
            return cls(name=data["name"], num_layers=int(data["num_layers"]), seq_len=int(data["seq_len"]),
                       dtype=data["dtype"], tp_divisor=int(data["tp_divisor"]),
                       act_itemsize=int(data["act_itemsize"]), boundary=float(data["boundary"]),
                       tokens=float(data["tokens"]), first=_table(data["first"]),
                       kinds=tuple(_table(k) for k in data["kinds"]), last=_table(data["last"]),
                       backend=data.get("backend", ""))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: malformed cost facts ({type(e).__name__}: {e})") from None


def _table(d: Mapping) -> PartTable:
    rows = []
    for tp, f in d["by_tp"]:
        gemms = tuple(GemmFact(float(g["flops"]), tuple(float(x) for x in g["shape"]), g["scale"])
                      for g in f["gemms"])
        rows.append((int(tp), PartFacts(gemms=gemms, **{k: float(v) for k, v in f.items() if k != "gemms"})))
    return PartTable(tuple(rows), float(d.get("share", 1.0)))
