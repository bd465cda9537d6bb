"""The one pipeline-time formula (`cfp.runtime.schedules.pipeline_time`) against the longest path of the
stage x micro-batch grid computed cell by cell, in the two cases the planner and the data pass use it."""
import numpy as np
import pytest

from cfp.runtime.schedules import SCHEDULES, pipeline_time


def _longest_path(cells: np.ndarray) -> float:
    """A fill-drain pipeline: cell (i, j) starts when stage i finished j-1 and stage i-1 finished j."""
    s, m = cells.shape
    done = np.zeros((s + 1, m + 1))
    for i in range(1, s + 1):
        for j in range(1, m + 1):
            done[i, j] = max(done[i - 1, j], done[i, j - 1]) + cells[i - 1, j - 1]
    return float(done[s, m])


@pytest.mark.parametrize("seed", range(5))
def test_formula_is_the_longest_path_when_stages_or_microbatches_cost_alike(seed):
    rng = np.random.default_rng(seed)
    stages = rng.uniform(0.1, 2.0, rng.integers(1, 6)).tolist()
    micro = rng.uniform(0.1, 2.0, rng.integers(1, 9)).tolist()
    c = len(micro)
    assert pipeline_time(stages, c) == pytest.approx(_longest_path(np.outer(stages, np.ones(c))))
    pp = len(stages)
    assert pipeline_time([1.0] * pp, micro) == pytest.approx(_longest_path(np.outer(np.ones(pp), micro)))
    # in general it bounds the longest path from above (the path through the slowest row and column)
    assert pipeline_time(stages, micro) >= _longest_path(np.outer(stages, micro)) - 1e-12


def test_every_schedule_prices_and_stores():
    for sched in SCHEDULES.values():
        assert sched.time([1.0, 2.0], 3) == pytest.approx(1 + 2 + 2 * 2)
        assert all(1 <= sched.stored_inputs(i, 4, 8) <= 8 for i in range(4))
