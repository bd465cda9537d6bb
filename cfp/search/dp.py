"""Dynamic programming over the segment sequence under a per-device memory budget.

Position i picks one candidate j (a profiled strategy combination of segment i) with time `cost[i][j]` and
per-device memory `mem[i][j]`; consecutive picks pay `trans[i][j][k]` (resharding between segment i's candidate j
and segment i+1's candidate k). Memory adds up over segments and must stay within the budget; the DP keeps, for
every (position, candidate), the Pareto frontier of (memory, time), which makes it exact (see the brute-force
test), and returns the best complete plans in order of time.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from cfp.errors import InfeasibleError
from cfp.search.options import fmt_bytes


@dataclasses.dataclass(frozen=True)
class DPSolution:
    picks: tuple[int, ...]     # candidate index per position
    time: float
    memory: int


def min_memory(mem: Sequence[Sequence[int]]) -> int:
    return sum(min(m) for m in mem)


def dp_search(cost: Sequence[Sequence[float]], mem: Sequence[Sequence[int]],
              trans: Sequence[Sequence[Sequence[float]]], budget: float | None, n_best: int = 1) -> list[DPSolution]:
    """The `n_best` fastest plans (Pareto-optimal in memory) within `budget` bytes (None: unbounded)."""
    if not cost:
        return [DPSolution((), 0.0, 0)]
    limit = float("inf") if budget is None else budget
    need = min_memory(mem)
    if need > limit:
        raise InfeasibleError(f"memory budget {fmt_bytes(limit)} per device is infeasible: the smallest plan "
                              f"needs {fmt_bytes(need)} ({need} bytes) per device")
    # frontier[j]: list of (memory, time, picks) non-dominated, for plans ending in candidate j
    frontier = [[(mem[0][j], cost[0][j], (j,))] if mem[0][j] <= limit else [] for j in range(len(cost[0]))]
    for i in range(1, len(cost)):
        nxt = []
        for k in range(len(cost[i])):
            cands = [(m + mem[i][k], t + trans[i - 1][j][k] + cost[i][k], picks + (k,))
                     for j, front in enumerate(frontier) for (m, t, picks) in front
                     if m + mem[i][k] <= limit]
            nxt.append(_pareto(cands))
        frontier = nxt
    final = sorted((t, m, p) for front in frontier for (m, t, p) in front)
    return [DPSolution(p, t, m) for t, m, p in final[:n_best]]


def _pareto(cands):
    """Keep entries no other entry beats in both memory and time."""
    out, best_t = [], float("inf")
    for m, t, p in sorted(cands, key=lambda c: (c[0], c[1])):
        if t < best_t:
            out.append((m, t, p))
            best_t = t
    return out

