"""A small HiGHS (highspy) front end for the dispatch and packing ILPs: columns in [0,1] or [0,inf), rows
lo <= Σ v·x <= hi, minimise c·x under a time limit."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Milp:
    num_cols: int
    cost: np.ndarray
    upper: np.ndarray
    integer: np.ndarray          # bool per column
    rows: list = dataclasses.field(default_factory=list)

    @classmethod
    def new(cls, num_binary: int, num_continuous: int) -> "Milp":
        n = num_binary + num_continuous
        return cls(n, np.zeros(n), np.concatenate([np.ones(num_binary), np.full(num_continuous, np.inf)]),
                   np.arange(n) < num_binary)

    def add_row(self, cols, vals, lo: float, hi: float) -> None:
        self.rows.append((list(cols), list(vals), lo, hi))

    def solve(self, time_limit: float, start: np.ndarray | None = None) -> tuple[np.ndarray | None, bool]:
        """(column values or None if no solution was found in time, proved optimal). `start`: a feasible
        point (every column) HiGHS starts from, so the result is never worse than it."""
        import highspy

        inf = highspy.kHighsInf
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(time_limit))
        h.setOptionValue("mip_rel_gap", 1e-6)
        up = np.where(np.isinf(self.upper), inf, self.upper)
        h.addVars(self.num_cols, np.zeros(self.num_cols), up)
        h.changeColsCost(self.num_cols, np.arange(self.num_cols, dtype=np.int32), self.cost.astype(float))
        ints = np.flatnonzero(self.integer).astype(np.int32)
        h.changeColsIntegrality(ints.size, ints, np.full(ints.size, highspy.HighsVarType.kInteger, np.uint8))
        starts, idx, val, lo, hi = [], [], [], [], []
        for cols, vals, l, u in self.rows:
            starts.append(len(idx))
            idx.extend(cols)
            val.extend(vals)
            lo.append(-inf if l == -np.inf else l)
            hi.append(inf if u == np.inf else u)
        h.addRows(len(lo), np.array(lo, float), np.array(hi, float), len(idx), np.array(starts, np.int32),
                  np.array(idx, np.int32), np.array(val, float))
        if start is not None:
            h.setSolution(self.num_cols, np.arange(self.num_cols, dtype=np.int32), np.asarray(start, float))
        h.run()
        status = h.getModelStatus()
        sol = np.array(h.getSolution().col_value)
        if sol.size < self.num_cols or status == highspy.HighsModelStatus.kInfeasible:
            return None, False
        return sol, status == highspy.HighsModelStatus.kOptimal
