"""The one pipeline-time formula (`cfp.schedules.registry.pipeline_time`) against the longest path of the
stage x micro-batch grid computed cell by cell, in the two cases the planner and the data pass use it."""
import numpy as np
import pytest

from cfp.schedules.registry import SCHEDULES, pipeline_time


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
    third = lambda xs: [x / 3 for x in xs]
    for name, sched in SCHEDULES.items():
        # stages of 1 s and 2 s per micro-batch (F = B = W), 3 micro-batches: 1F1B's 1 + 2 + 2 * 2, and no
        # schedule beats the slower stage's own 3 * 2 s
        t = sched.seconds(third([1.0, 2.0]), third([1.0, 2.0]), third([1.0, 2.0]), 3, sched.default_v)
        if not sched.split and sched.default_v == 1:
            assert t == pytest.approx(1 + 2 + 2 * 2)
        assert 3 * 2 <= t <= 1 + 2 + 2 * 2 + 1e-12, name
        for i in range(4):
            inputs, stashes = sched.counts(i, 4, 8, sched.default_v)
            assert 1 <= inputs <= 8 * sched.default_v and 0 <= stashes <= 8 * sched.default_v
            assert (stashes > 0) == sched.split
