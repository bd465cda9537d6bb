"""SchemeMix proposal (Hydraulis): a set of pipelines with different <CP,TP,PP> schemes for a length distribution.

Dynamic program over (devices, length interval): t[u][j] is the least step time with u device units for all
sequences of length <= b_j, where b_0 < b_1 < ... are length boundaries (quantiles of the data plus every
scheme's maximum length). A transition gives the sequences of (b_i, b_j] to d pipelines of one scheme k that
fits b_j: max(t[u - d·g_k][i], W_k(i,j)/d + (pp_k-1)·cost_k(b_j)), where W_k is the expected per-step cost of
those sequences (sequence costs plus one micro-batch overhead per max_len tokens), the counts scaled from the
data set to `tokens_per_step`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

import numpy as np

from cfp.data.schemes import Scheme, SchemeSpace, scheme_json
from cfp.errors import ConfigError, InfeasibleError
from cfp.files import write_json_atomic


@dataclasses.dataclass(frozen=True)
class Group:
    """`pipelines` pipelines of `scheme`, planned for the sequences of length in (min_len, max_len]."""
    scheme: Scheme
    pipelines: int
    min_len: int
    max_len: int


@dataclasses.dataclass(frozen=True)
class SchemeMix:
    groups: tuple[Group, ...]
    estimated_step_s: float   # the DP's estimate for tokens_per_step (cost-model or measured fits)
    devices: int

    def pipelines(self) -> list[Scheme]:
        """One scheme per pipeline, longest-capacity groups last."""
        return [g.scheme for g in self.groups for _ in range(g.pipelines)]

    def to_json(self) -> dict:
        return {"estimated_step_s": self.estimated_step_s, "devices": self.devices,
                "groups": [dict(dataclasses.asdict(g), scheme=scheme_json(g.scheme)) for g in self.groups]}

    @classmethod
    def from_json(cls, d: dict) -> "SchemeMix":
        try:
            groups = tuple(Group(Scheme(**g["scheme"]), int(g["pipelines"]), int(g["min_len"]), int(g["max_len"]))
                           for g in d["groups"])
            return cls(groups, float(d["estimated_step_s"]), int(d["devices"]))
        except (KeyError, TypeError) as e:
            raise ConfigError(f"not a mix file ({e}); write one with `cfp data propose`") from None

    def save(self, path: str) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "SchemeMix":
        try:
            with open(path) as fh:
                return cls.from_json(json.load(fh))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read mix file {path!r}: {e}") from None

    def describe(self) -> str:
        return ", ".join(f"{g.pipelines}x{g.scheme.name}[{g.min_len + 1}..{g.max_len}]" for g in self.groups)


def boundaries(lengths: np.ndarray, schemes: Sequence[Scheme], num: int = 16) -> np.ndarray:
    qs = np.quantile(lengths, np.linspace(0, 1, num + 1)[1:]).astype(np.int64)
    caps = [s.max_len for s in schemes if s.max_len < lengths.max()]
    return np.unique(np.concatenate([[0], qs, caps, [lengths.max()]]))


def _interval_work(lengths: np.ndarray, bounds: np.ndarray, s: Scheme, scale: float) -> np.ndarray:
    """Per-step cost of each interval's sequences under scheme s (inf where s cannot hold them)."""
    idx = np.searchsorted(bounds, lengths, side="left")     # interval j holds (b_{j-1}, b_j]
    per_seq = s.seq_cost(lengths) + s.c * lengths / s.max_len
    work = np.bincount(idx, per_seq, minlength=bounds.size)[1:] * scale
    work[bounds[1:] > s.max_len] = np.inf
    return work


def propose(space: SchemeSpace, lengths, gpus: int, tokens_per_step: float, num_bounds: int = 16,
            max_units: int = 256) -> SchemeMix:
    lengths = np.asarray(lengths, np.int64)
    if gpus < 1 or tokens_per_step <= 0 or lengths.size == 0:
        raise ConfigError(f"propose needs gpus >= 1 (got {gpus}), tokens_per_step > 0 (got {tokens_per_step}) "
                          "and at least one sequence")
    schemes = [s for s in space.schemes if s.devices <= gpus]
    if not schemes:
        raise InfeasibleError(f"no scheme fits {gpus} GPUs (smallest needs "
                              f"{min(s.devices for s in space.schemes)})")
    if lengths.max() > max(s.max_len for s in schemes):
        raise InfeasibleError(f"the longest sequence ({lengths.max()}) fits no scheme (longest capacity "
                              f"{max(s.max_len for s in schemes)}); analyse with a smaller --max-seq-len")
    unit = max(1, 1 << int(math.log2(max(1, gpus // max_units))))
    units = gpus // unit
    bounds = boundaries(lengths, schemes, num_bounds)
    scale = tokens_per_step / float(lengths.sum())
    work = [np.cumsum(np.concatenate([[0.0], _interval_work(lengths, bounds, s, scale)])) for s in schemes]
    t, choice = _dp(schemes, bounds, work, units, unit)
    u = int(np.argmin(t[:, -1]))
    if not np.isfinite(t[u, -1]):
        raise InfeasibleError(f"no mix on {gpus} GPUs holds every length (schemes' max lengths too short)")
    return SchemeMix(_backtrack(choice, schemes, bounds, u, unit), float(t[u, -1]), u * unit)


def _blocks(s: Scheme, unit: int) -> tuple[int, int]:
    """(device units per block, pipelines per block) of scheme s."""
    return (s.devices // unit, 1) if s.devices >= unit else (1, unit // s.devices)


def _dp(schemes, bounds, work, units: int, unit: int):
    nb = bounds.size
    t = np.full((units + 1, nb), np.inf)
    t[:, 0] = 0.0
    choice = {}
    u_idx = np.arange(units + 1)
    for j in range(1, nb):
        best = np.full(units + 1, np.inf)
        arg = np.full((units + 1, 4), -1, np.int64)
        for k, s in enumerate(schemes):
            if s.max_len < bounds[j] or s.devices % unit and s.devices > unit:
                continue
            ub, pb = _blocks(s, unit)
            bubble = (s.pp - 1) * float(s.seq_cost(bounds[j]) + s.c)
            d = np.arange(1, units // ub + 1)                            # blocks of this scheme
            prev_u = u_idx[:, None] - d[None, :] * ub                    # [U, D]
            valid = prev_u >= 0
            for i in range(j):
                w = work[k][j] - work[k][i]
                if not np.isfinite(w):
                    continue
                own = w / (d * pb) + bubble                               # [D]
                prev = np.where(valid, t[np.clip(prev_u, 0, None), i], np.inf)
                cand = np.maximum(prev, own[None, :])
                dbest = np.argmin(cand, axis=1)
                val = cand[u_idx, dbest]
                better = val < best
                best = np.where(better, val, best)
                arg[better] = np.stack([np.full(better.sum(), k), np.full(better.sum(), i),
                                        d[dbest[better]], np.zeros(better.sum(), np.int64)], 1)
        # unused devices allowed: t[u][j] <= t[u-1][j]
        for u in range(1, units + 1):
            if best[u - 1] <= best[u]:
                best[u] = best[u - 1]
                arg[u] = arg[u - 1].copy()
                arg[u, 3] += 1                                           # units left idle here
        t[:, j] = best
        choice[j] = arg
    return t, choice


def _backtrack(choice, schemes, bounds, u: int, unit: int) -> tuple[Group, ...]:
    groups, j = [], bounds.size - 1
    while j > 0:
        k, i, d, idle = (int(x) for x in choice[j][u])
        s = schemes[k]
        ub, pb = _blocks(s, unit)
        groups.append(Group(s, d * pb, int(bounds[i]), int(bounds[j])))
        u -= idle + d * ub
        j = i
    return tuple(_merge(groups[::-1]))


def _merge(groups: list[Group]) -> list[Group]:
    """Adjacent intervals given to the same scheme become one group."""
    out: list[Group] = []
    for g in groups:
        if out and out[-1].scheme == g.scheme:
            last = out.pop()
            g = Group(g.scheme, last.pipelines + g.pipelines, last.min_len, g.max_len)
        out.append(g)
    return out
