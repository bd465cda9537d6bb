"""Independent references the tests check the package against, and test-only readers: exhaustive searches for
the DP search and the ILP baseline, the packing ILP, a timeline file's reader, the per-kind totals of collectives
and whether every pipeline holds the same parameters. They live here, not in the package, because only tests
use them."""
from __future__ import annotations

import itertools
import json
import math
import os
from typing import Sequence

import jax
import numpy as np

from cfp.baselines.ilp import Problem
from cfp.data.milp import Milp
from cfp.data.packing import MicroBatches, _check
from cfp.data.schemes import CostForm, Scheme
from cfp.errors import ConfigError, InfeasibleError
from cfp.runtime.timeline import Timeline
from cfp.search.dp import DPSolution


def dp_brute_force(cost, mem, trans, budget: float | None) -> DPSolution | None:
    """Exhaustive reference for `cfp.search.dp.dp_search`: the fastest plan within budget, or None."""
    limit = float("inf") if budget is None else budget
    best = None
    for picks in itertools.product(*[range(len(c)) for c in cost]):
        m = sum(mem[i][j] for i, j in enumerate(picks))
        if m > limit:
            continue
        t = sum(cost[i][j] for i, j in enumerate(picks))
        t += sum(trans[i][picks[i]][picks[i + 1]] for i in range(len(picks) - 1))
        if best is None or t < best.time:
            best = DPSolution(picks, t, m)
    return best


def ilp_brute_force(problem: Problem, memory_budget: float | None = None) -> tuple[tuple[int, ...], float]:
    """Exhaustive minimum of the ILP baseline's objective (`cfp.baselines.ilp.solve`; only for tiny problems)."""
    best, best_cost = None, math.inf
    for node_choice in itertools.product(*(range(n.k) for n in problem.nodes)):
        if memory_budget is not None and problem.memory(node_choice) > memory_budget:
            continue
        c = problem.cost(node_choice)
        if c < best_cost - 1e-15:
            best, best_cost = node_choice, c
    if best is None:
        raise InfeasibleError("no layout fits the memory budget")
    return best, best_cost


def pack_ilp(lengths: Sequence[int], scheme: Scheme, m: int, max_len: int | None = None,
             time_limit: float = 0.5) -> tuple[MicroBatches | None, bool]:
    """HiGHS: m micro-batches minimising the slowest one (a·Σs²+b·Σs+c, varlen schemes) under the token
    limit. Returns (micro-batches or None if none found in time, proved optimal)."""
    if scheme.form is not CostForm.VARLEN:
        raise ConfigError("the packing ILP is linear in Σs²; row-layout schemes are packed greedily")
    lengths = np.asarray(lengths, np.int64)
    max_len = scheme.max_len if max_len is None else max_len
    _check(lengths, max_len)
    n = lengths.size
    cost = scheme.seq_cost(lengths)
    unit = max(float(cost.max()), 1e-30)  # costs in units of the dearest sequence: O(1) for HiGHS
    p = Milp.new(n * m, 1)
    z = n * m                             # the slowest micro-batch, in `unit`s
    p.cost[z] = 1.0
    for i in range(n):
        p.add_row([i * m + j for j in range(m)], [1.0] * m, 1.0, 1.0)
    for j in range(m):
        cols = [i * m + j for i in range(n)]
        p.add_row(cols, lengths.astype(float).tolist(), -np.inf, float(max_len))
        p.add_row(cols + [z], (cost / unit).tolist() + [-1.0], -np.inf, -scheme.c / unit)
    sol, optimal = p.solve(time_limit)
    if sol is None:
        return None, False
    x = sol[:z].reshape(n, m)
    mbs = [list(np.flatnonzero(x[:, j] > 0.5)) for j in range(m)]
    return [mb for mb in mbs if mb], optimal


def load_timeline(path: str | os.PathLike) -> Timeline:
    """A `Timeline` back from `Timeline.save_json`'s file (ConfigError when it is not one)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "events" not in data:
        raise ConfigError(f"{os.fspath(path)!r} is not a cfp timeline JSON (no 'events' list)")
    tl = Timeline(unmeasured=data.get("unmeasured", 0))
    for e in data["events"]:
        tl.record(e["pipeline"], e["stage"], e["microbatch"], e["phase"], e["start"], e["end"])
    return tl


def identical_across_pipelines(trainer) -> bool:
    """Whether every pipeline holds bit-identical values of every parameter (single process: all stages local)."""
    from cfp.layered.model import merge_stage_params
    full = []
    for p in range(len(trainer.run_layout.pipelines)):
        parts = [jax.tree_util.tree_map(np.asarray, trainer.params[st.key]) for st in trainer.run_layout.placed_in(p)]
        full.append(jax.tree_util.tree_leaves(merge_stage_params(parts, trainer.model.stacked)))
    return all(len(f) == len(full[0]) and all(np.array_equal(a, b) for a, b in zip(f, full[0])) for f in full[1:])


def summarize(collectives) -> dict[str, int]:
    """Total bytes per collective kind."""
    totals: dict[str, int] = {}
    for kind, group in itertools.groupby(sorted(collectives, key=lambda c: c.kind), key=lambda c: c.kind):
        totals[kind] = sum(c.bytes for c in group)
    return totals
