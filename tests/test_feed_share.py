"""Each process's share of a step's global batch (cfp.runtime.feed.Share, `cfp.process_share`): which pipelines a
process feeds (those whose first or last stage it hosts), where a share's rows go in the global batch the engine
takes, the whole batch handed to a process still taken as is, the replay's gathered whole batch (row by row from
the first process feeding it, bit-exact for every dtype), the cross-process agreement check, and `cfp data train`
joining the launcher's job through the function `cfp train` calls. Fast: no process is spawned (the 2-process runs
are tests/test_feed_multiprocess.py)."""
import types

import numpy as np
import pytest

import cfp
from cfp.errors import ConfigError
from cfp.layout import Layout
from cfp.runtime import feed

# 2 processes x 4 devices; pipeline 0 on process 0, pipeline 1 on process 1, pipeline 2 from process 0 (its first
# stage) to process 1 (its last): process 0 feeds rows 0-3 and 6-7, process 1 rows 4-7
DEVICES = [types.SimpleNamespace(process_index=d // 4) for d in range(8)]
CROSSING = Layout.from_lists([[2, 1], [1, 1], [1, 1]], [[2, 1], [1, 2], [2, 1]], [4, 2, 2], [2, 1, 1],
                             [[[0, 1], [2]], [[4], [5]], [[3], [6]]])
# one pipeline whose middle stage alone is on process 1: process 1 feeds nothing
MIDDLE = Layout.from_lists([[1, 1, 1]], [[1, 1, 1]], [2], [1], [[[0], [4], [1]]])


def _global(rows: int = 8):
    rng = np.random.default_rng(0)
    return {"x": rng.integers(0, 99, (rows, 3)).astype(np.int64), "m": rng.random((rows, 3)) < 0.5,
            "w": rng.random((rows,)).astype(np.float64)}


def test_a_process_feeds_the_pipelines_whose_first_or_last_stage_it_hosts():
    s0, s1 = (feed.process_share(CROSSING, p, DEVICES) for p in (0, 1))
    assert (s0.pipelines, s0.ranges, s0.rows) == ((0, 2), ((0, 4), (6, 8)), 6)
    assert (s1.pipelines, s1.ranges, s1.rows) == ((1, 2), ((4, 6), (6, 8)), 4)
    assert list(s0.indices) == [0, 1, 2, 3, 6, 7] and not s0.whole
    m0, m1 = (feed.process_share(MIDDLE, p, DEVICES) for p in (0, 1))
    assert m0.whole and (m1.pipelines, m1.rows) == ((), 0)
    assert feed.process_share(CROSSING, 0).whole          # one process: all 8 of this host's devices
    assert cfp.process_share is feed.process_share
    with pytest.raises(ConfigError, match=r"layout uses device 4 \(7 devices in all\) but only 4 devices exist"):
        feed.process_share(CROSSING, 0, DEVICES[:4])


def test_a_share_is_placed_at_its_rows_and_the_whole_batch_is_taken_as_is():
    g = _global()
    s0 = feed.process_share(CROSSING, 0, DEVICES)
    assert s0.fill(g) is g                                 # the whole batch: handed on untouched
    mine = s0.take(g)
    assert all(v.shape[0] == 6 for v in mine.values()) and np.array_equal(mine["x"], g["x"][[0, 1, 2, 3, 6, 7]])
    placed = s0.fill(mine)
    for k, v in g.items():
        assert placed[k].dtype == v.dtype and placed[k].shape == v.shape
        assert np.array_equal(placed[k][s0.indices], v[s0.indices])
        assert not np.any(placed[k][4:6])                  # rows of process 1's pipeline: zeros, read by no stage


def _handed(fed, shares, fn):
    """What every process hands to ``fn(batch, shares, gather)``'s gather, stacked (as process_allgather gives
    it), ``fed[p]`` being process p's batch."""
    class Handed(Exception):
        pass
    handed = []

    def capture(x):
        handed.append(x)
        raise Handed
    for batch in fed:
        with pytest.raises(Handed):
            fn(batch, shares, capture)
    import jax
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *handed)


def _as_processes(fed, shares, fn):
    """``fn(batch, shares, gather)`` run as every process, ``fed[p]`` process p's batch."""
    stacked = _handed(fed, shares, fn)
    return [fn(batch, shares, lambda x: stacked) for batch in fed]


def test_the_replays_whole_batch_is_gathered_row_by_row_from_its_feeder():
    g = _global()
    shares = [feed.process_share(CROSSING, p, DEVICES) for p in (0, 1)]
    # process 0 feeds its share; process 1 the whole batch, wrong in the rows it does not feed (never read there)
    wrong = dict(g, x=g["x"].copy(), w=g["w"].copy())
    wrong["x"][:4], wrong["w"][:4] = -1, np.nan
    fed = [shares[0].fill(shares[0].take(g)), wrong]
    for whole in _as_processes(fed, shares, feed._whole):
        for k, v in g.items():
            assert whole[k].dtype == v.dtype and whole[k].tobytes() == v.tobytes(), k


def test_processes_feeding_other_dims_fail_on_every_process_in_one_line():
    g = _global()
    shares = [feed.process_share(CROSSING, p, DEVICES) for p in (0, 1)]
    same = [shares[p].fill(shares[p].take(g)) for p in (0, 1)]
    _as_processes(same, shares, lambda b, s, gather: feed._agree("batches", 3, b, gather))
    longer = dict(same[1], x=np.zeros((8, 4), np.int64))       # process 1's x one column longer
    agree = lambda b, s, gather: feed._agree("batches", 3, b, gather)
    stacked = _handed([same[0], longer], shares, agree)
    for batch in (same[0], longer):                              # as process 0, then as process 1
        with pytest.raises(ConfigError) as e:
            agree(batch, shares, lambda x: stacked)
        assert "step 3's batch differs between the processes: process(es) [1]" in str(e.value)
        assert "\n" not in str(e.value)


def test_a_per_step_batch_is_the_global_batch_or_this_processs_share(monkeypatch):
    """As process 0 of the crossing layout (its share forced here): 6-row batches placed at their rows, 8-row ones
    taken whole, any other count a one-line error naming both."""
    from test_feed import _model
    real = feed.process_share
    monkeypatch.setattr(feed, "process_share", lambda layout, process=None, devices=None: real(layout, 0, DEVICES))
    model = _model()
    rng = np.random.default_rng(1)
    batch = lambda rows: {"x": rng.integers(0, 32, (rows, 8)).astype(np.int32),
                          "y": rng.integers(0, 32, (rows, 8)).astype(np.int32), "w": np.ones((rows, 8), np.float32)}
    given = [batch(6), batch(8)]
    step = feed.step_batches(given, model).for_run(CROSSING, replay=False)
    got0, got1 = step(0), step(1)
    assert got0["x"].shape == (8, 8) and np.array_equal(got0["x"][[0, 1, 2, 3, 6, 7]], given[0]["x"])
    assert got1 is given[1] or all(np.array_equal(got1[k], given[1][k]) for k in "xyw")
    bad = feed.step_batches([batch(6), batch(5)], model).for_run(CROSSING, replay=False)
    with pytest.raises(ConfigError) as e:
        bad(0)
    assert "step 1's batch" in str(e.value) and "has 5 rows; the layout's global batch is 8 rows" in str(e.value)
    assert "this process's share 6 (process 0 feeds pipelines [0, 2]: cfp.process_share)" in str(e.value)


@pytest.mark.parametrize("argv", [
    ["train", "--model", "llama2", "--num-layers", "2", "--hetero-configs", "[[1,1]]", "--data", "files",
     "--data-path", "missing.txt"],
    ["data", "train", "--model", "llama2", "--input", "missing.jsonl", "--steps", "1", "--mixes", "[[(1,1,1)]]"]])
def test_cfp_train_and_data_train_join_the_job_through_one_function(monkeypatch, argv, tmp_path):
    """Both entry points call `maybe_initialize_distributed` (the one join: `cfp launch`'s CFP_* variables, else the
    cluster launcher's) before their work: here it stops them, so nothing else ran (their input, missing, would
    fail at once after it)."""
    import cfp.runtime.launch as launch
    from cfp.cli.main import main

    class Joined(Exception):
        pass

    def join(*a, **k):
        raise Joined
    monkeypatch.setattr(launch, "maybe_initialize_distributed", join)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Joined):
        main(argv)
    assert not (tmp_path / "parallel_scheme_space.json").exists()
