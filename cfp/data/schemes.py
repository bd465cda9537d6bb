"""Parallel schemes <CP,TP,PP> for variable-length data: each with a fitted time per micro-batch and the longest
sequence that fits memory (the Hydraulis "scheme space").

A scheme's cost of a micro-batch holding sequences s_1..s_k (seconds per pipeline stage) has one of two forms:
    VARLEN (flash-attention varlen, the GPU cost model):  a·Σ s_i² + b·Σ s_i + c
    ROWS (this runtime, measured): the micro-batch's `cfp.data.rows` layout [R, W], a·E + b·R·W + c, with E
        the score entries packed causal attention computes on it (`cfp.data.rows.layout_entries`) -- what
        actually runs: padding and bucket rounding included, masked parts of the blocks it computes included.
A padded micro-batch (one sequence per row, `packed=False`) costs its padded rows in either form.
"""
from __future__ import annotations

import dataclasses
import enum
import json
from typing import Sequence

import numpy as np

from cfp.data.rows import WIDTHS, MicroBatchRows, arrange, layout_entries, seq_entries
from cfp.errors import ConfigError
from cfp.files import write_json_atomic


class CostForm(enum.Enum):
    VARLEN = "varlen"
    ROWS = "rows"


Shape = tuple[int, int, int]   # (cp, tp, pp)


@dataclasses.dataclass(frozen=True)
class Scheme:
    cp: int
    tp: int
    pp: int
    a: float
    b: float
    c: float
    max_len: int           # most token slots of a micro-batch (ROWS: R·W) that fit the memory budget
    form: CostForm = CostForm.VARLEN

    def __post_init__(self):
        for f in ("cp", "tp", "pp", "max_len"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"Scheme.{f}={v!r} must be a positive integer")
        for f in ("a", "b", "c"):
            v = getattr(self, f)
            if not np.isfinite(v) or v < 0:
                raise ConfigError(f"Scheme.{f}={v!r} must be a finite number >= 0")
        if not isinstance(self.form, CostForm):
            try:
                object.__setattr__(self, "form", CostForm(self.form))
            except ValueError:
                raise ConfigError(f"Scheme.form={self.form!r} is not one of "
                                  f"{[f.value for f in CostForm]}") from None
        if self.form is CostForm.ROWS and self.max_len not in WIDTHS:
            raise ConfigError(f"Scheme.max_len={self.max_len!r} of a row-layout scheme must be a row width "
                              f"({', '.join(map(str, WIDTHS[:8]))}, ...)")

    @property
    def devices(self) -> int:
        return self.cp * self.tp * self.pp

    @property
    def shape(self) -> Shape:
        return (self.cp, self.tp, self.pp)

    @property
    def name(self) -> str:
        return f"cp{self.cp}tp{self.tp}pp{self.pp}"

    def seq_cost(self, s):
        """Time of sequences of length s without the per-micro-batch c: VARLEN, the sequence's own; ROWS, its
        own causal blocks' attention (`seq_entries`; a ring: its share of its row's) and its s token slots
        (shorter sequences fill the rest of a row)."""
        s = np.asarray(s, np.float64)
        if self.form is CostForm.VARLEN:
            return self.a * s * s + self.b * s
        return self.a * seq_entries(s, self.cp > 1) + self.b * s

    def layout_cost(self, lay: MicroBatchRows, lengths: Sequence[int]) -> float:
        """ROWS: time of one micro-batch of sequences of `lengths` laid out as `lay` (`layout_entries`: ring
        attention scores every pair of a context-parallel stage's row)."""
        entries = layout_entries(lay, lengths, self.cp > 1)[0]
        return self.a * entries + self.b * lay.slots + self.c

    def mb_cost(self, lengths: Sequence[int], packed: bool = True) -> float:
        """Time of one micro-batch holding `lengths` (tokens of each sequence, in the micro-batch's order):
        packed, or padded (one sequence per row, each padded to the longest)."""
        lengths = np.asarray(lengths, np.float64)
        if lengths.size == 0:
            return 0.0
        if self.form is CostForm.ROWS:
            ints = lengths.astype(np.int64).tolist()
            return self.layout_cost(arrange(ints, packed), ints)
        if not packed:
            longest = float(lengths.max())
            return float(lengths.size * (self.a * longest * longest + self.b * longest) + self.c)
        t = lengths.sum()
        return float(self.a * float((lengths * lengths).sum()) + self.b * t + self.c)


@dataclasses.dataclass(frozen=True)
class SchemeSpace:
    """Schemes of one model: `source` says whether the fits are measured (device) or estimated (GPU).
    `parallel_pipelines` (measured spaces): how many pipelines these devices run side by side at the speed of
    one alone -- simulated CPU devices share the host's cores, so a step's pipelines slow each other down;
    None: each pipeline has devices of its own (GPUs). `max_seq_len`: the longest rows it was measured for
    (None: not recorded, files of older versions)."""
    model: str
    config: str
    source: str
    schemes: tuple[Scheme, ...]
    parallel_pipelines: float | None = None
    max_seq_len: int | None = None

    def __post_init__(self):
        if not self.schemes:
            raise ConfigError("a scheme space needs at least one scheme")
        p = self.parallel_pipelines
        if p is not None and not (np.isfinite(p) and p >= 1):
            raise ConfigError(f"parallel_pipelines={p!r} must be a number >= 1 (or None)")

    def reusable_for(self, model: str, config: str, max_seq_len: int) -> bool:
        """Whether this space's measured fits serve a run of `model`/`config` on rows up to `max_seq_len`: measured
        for that model and that row limit (a space measured for shorter rows holds no scheme for the longer
        sequences; one for longer rows caps schemes where this run's would not be capped)."""
        # older files record no row limit: measured again (one of 128-token rows reused for 2048 held nothing)
        return ((self.model, self.config) == (model, config) and self.source.startswith("measured")
                and self.max_seq_len == max_seq_len)

    def to_json(self) -> dict:
        return {"model": self.model, "config": self.config, "source": self.source,
                "parallel_pipelines": self.parallel_pipelines, "max_seq_len": self.max_seq_len,
                "schemes": [scheme_json(s) for s in self.schemes]}

    @classmethod
    def from_json(cls, d: dict) -> "SchemeSpace":
        try:
            if any("dense_rows" in s for s in d["schemes"]):
                raise ConfigError("this scheme space was measured by an older cfp (fits of whole-row dense "
                                  "attention, which no longer runs); measure it again with `cfp data schemes`")
            return cls(d["model"], d["config"], d["source"], tuple(Scheme(**s) for s in d["schemes"]),
                       d.get("parallel_pipelines"), d.get("max_seq_len"))
        except (KeyError, TypeError) as e:
            raise ConfigError(f"not a scheme-space file ({e}); write one with `cfp data schemes`") from None

    def save(self, path: str) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "SchemeSpace":
        try:
            with open(path) as fh:
                return cls.from_json(json.load(fh))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read scheme space {path!r}: {e}") from None

    @property
    def longest(self) -> int:
        return max(s.max_len for s in self.schemes)


def scheme_json(s: Scheme) -> dict:
    return dict(dataclasses.asdict(s), form=s.form.value)


def fit_nonnegative(features, times) -> tuple[float, ...]:
    """Least squares times ≈ features @ coef with every coefficient >= 0 (a negative one is dropped and the
    rest refitted)."""
    x = np.asarray(features, np.float64)
    t = np.asarray(times, np.float64)
    if x.shape[0] < x.shape[1] or not np.all(np.isfinite(t)):
        raise ConfigError(f"fitting {x.shape[1]} coefficients needs at least {x.shape[1]} finite timings")
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], t, rcond=None)
        if np.all(coef >= 0) or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = [0.0] * x.shape[1]
    for i, v in zip(keep, coef):
        out[i] = max(float(v), 0.0)
    return tuple(out)


def fit_quadratic(lengths, times) -> tuple[float, float, float]:
    """Least-squares a·s²+b·s+c with every coefficient >= 0 (a negative fit term is dropped and refitted)."""
    s = np.asarray(lengths, np.float64)
    if s.size < 3:
        raise ConfigError("fitting a·s²+b·s+c needs at least 3 finite timings")
    return fit_nonnegative(np.stack([s * s, s, np.ones_like(s)], 1), times)
