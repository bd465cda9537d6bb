"""Parallel schemes <CP,TP,PP> for variable-length data: each with a fitted time per micro-batch and the longest
sequence that fits memory (the Hydraulis "scheme space").

A scheme's cost of a micro-batch holding sequences s_1..s_k is
    varlen attention (flash-attention style, cost-model schemes): a·Σ s_i² + b·Σ s_i + c
    dense rows (cfp's masked einsum attention, measured schemes): a·(Σ s_i)² + b·Σ s_i + c
(seconds per pipeline stage), since a packed row under a dense mask pays attention over the whole row.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import numpy as np

from cfp.errors import ConfigError
from cfp.files import write_json_atomic


@dataclasses.dataclass(frozen=True)
class Scheme:
    cp: int
    tp: int
    pp: int
    a: float
    b: float
    c: float
    max_len: int           # longest micro-batch (tokens) that fits the memory budget
    dense_rows: bool = False

    def __post_init__(self):
        for f in ("cp", "tp", "pp", "max_len"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"Scheme.{f}={v!r} must be a positive integer")
        for f in ("a", "b", "c"):
            v = getattr(self, f)
            if not np.isfinite(v) or v < 0:
                raise ConfigError(f"Scheme.{f}={v!r} must be a finite number >= 0")

    @property
    def devices(self) -> int:
        return self.cp * self.tp * self.pp

    @property
    def name(self) -> str:
        return f"cp{self.cp}tp{self.tp}pp{self.pp}"

    def seq_cost(self, s):
        """Time of sequences of length s, each alone in a micro-batch, without the per-micro-batch c."""
        s = np.asarray(s, np.float64)
        return self.a * s * s + self.b * s

    def mb_cost(self, lengths: Sequence[int]) -> float:
        """Time of one micro-batch holding `lengths` (tokens of each sequence)."""
        lengths = np.asarray(lengths, np.float64)
        if lengths.size == 0:
            return 0.0
        t = lengths.sum()
        quad = t * t if self.dense_rows else float((lengths * lengths).sum())
        return float(self.a * quad + self.b * t + self.c)


@dataclasses.dataclass(frozen=True)
class SchemeSpace:
    """Schemes of one model: `source` says whether the fits are measured (device) or estimated (GPU)."""
    model: str
    config: str
    source: str
    schemes: tuple[Scheme, ...]

    def __post_init__(self):
        if not self.schemes:
            raise ConfigError("a scheme space needs at least one scheme")

    def to_json(self) -> dict:
        return {"model": self.model, "config": self.config, "source": self.source,
                "schemes": [dataclasses.asdict(s) for s in self.schemes]}

    @classmethod
    def from_json(cls, d: dict) -> "SchemeSpace":
        try:
            return cls(d["model"], d["config"], d["source"], tuple(Scheme(**s) for s in d["schemes"]))
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


def fit_quadratic(lengths, times) -> tuple[float, float, float]:
    """Least-squares a·s²+b·s+c with every coefficient >= 0 (a negative fit term is dropped and refitted)."""
    s = np.asarray(lengths, np.float64)
    t = np.asarray(times, np.float64)
    if s.size < 3 or not np.all(np.isfinite(t)):
        raise ConfigError("fitting a·s²+b·s+c needs at least 3 finite timings")
    cols = [s * s, s, np.ones_like(s)]
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(np.stack([cols[i] for i in keep], 1), t, rcond=None)
        if np.all(coef >= 0) or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = [0.0, 0.0, 0.0]
    for i, v in zip(keep, coef):
        out[i] = max(float(v), 0.0)
    return out[0], out[1], out[2]
