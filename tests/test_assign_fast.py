"""The per-step assignment's fast paths (issue 39 item 4) against plain references written here: the packing
greedy (its vectorised first round, heap and early failure), first-fit (bisection in the running maximum of the
rooms) and the dispatch greedy (per-kind runs) each give the assignment of the obvious O(n·m) loop it replaces,
on random steps, degenerate costs included."""
import numpy as np
import pytest

from cfp.data.batching import METHODS, assign_step
from cfp.data.dispatch import dispatch_greedy
from cfp.data.packing import _lpt, pack_balanced, pack_fixed, pipeline_time
from cfp.data.schemes import Scheme
from cfp.schedules.registry import pipeline_time as schedule_time


def _scheme(rng, max_len):
    a, b, c = (float(rng.choice(v)) for v in ((0.0, 1e-9, 1e-8), (0.0, 1e-6, 1e-5), (0.0, 1e-5, 1e-3)))
    return Scheme(1, int(rng.integers(1, 3)), int(rng.integers(1, 6)), a, b, c, max_len)


def _lengths(rng, n, cap):
    return np.minimum(rng.lognormal(rng.uniform(3, 7), rng.uniform(0.3, 1.5), n).astype(np.int64)
                      + int(rng.integers(0, 2)), cap)


def _greedy_reference(lengths, scheme, m, max_len):
    """Longest first (stable), each sequence into the cheapest micro-batch with room, the lowest index among
    equals, scanning all m: (micro-batches in index order, pipeline time) or None if one does not fit."""
    tokens, sq, bins = [0] * m, [0] * m, [[] for _ in range(m)]
    cost = [scheme.c] * m
    for i in np.argsort(-lengths, kind="stable").tolist():
        s = int(lengths[i])
        fits = [j for j in range(m) if tokens[j] + s <= max_len]
        if not fits:
            return None
        j = min(fits, key=lambda j: (cost[j], j))
        tokens[j] += s
        sq[j] += s * s
        cost[j] = scheme.a * sq[j] + scheme.b * tokens[j] + scheme.c
        bins[j].append(i)
    used = [j for j in range(m) if bins[j]]
    return [bins[j] for j in used], schedule_time([1.0] * scheme.pp, [cost[j] for j in used])


def _first_fit_reference(lengths, max_len):
    bins, room = [], []
    for i, s in enumerate(np.asarray(lengths).tolist()):
        j = next((j for j, r in enumerate(room) if s <= r), None)
        if j is None:
            bins.append([i])
            room.append(max_len - s)
        else:
            bins[j].append(i)
            room[j] -= s
    return bins


def _dispatch_reference(pipelines, lengths):
    """Longest first: per kind of pipeline the least loaded one (lowest index among equals), whose estimate
    grows by the sequence's cost (pp times for its first); the kind whose pipeline grows to the least wins,
    the one of least capacity among equals."""
    kinds = sorted(set(pipelines), key=lambda s: s.max_len)
    load, started = [0.0] * len(pipelines), [False] * len(pipelines)
    out = np.empty(len(lengths), np.int64)
    for i in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        best = None
        for k in kinds:
            if k.max_len < lengths[i]:
                continue
            p = min((p for p, s in enumerate(pipelines) if s == k), key=lambda p: (load[p], p))
            t = load[p] + float(k.seq_cost(lengths[i])) * (1 if started[p] else k.pp)
            if best is None or t < best[0]:
                best = (t, p)
        load[best[1]], started[best[1]] = best
        started[best[1]] = True
        out[i] = best[1]
    return out


def test_packing_greedy_matches_the_plain_loop():
    """Every count from the least to 12 more, with and without a `stop` just above or below the greedy's own
    time: the same micro-batches and time, or None exactly where the reference's time reaches `stop`."""
    rng = np.random.default_rng(0)
    checked = failed = 0
    for _ in range(60):
        max_len = int(rng.choice([256, 1024, 4096]))
        scheme = _scheme(rng, max_len)
        lens = _lengths(rng, int(rng.integers(1, 160)), max_len)
        order = np.argsort(-lens, kind="stable")
        m0 = -(-int(lens.sum()) // max_len)
        for m in range(m0, min(m0 + 12, lens.size) + 1):
            ref = _greedy_reference(lens, scheme, m, max_len)
            got = _lpt(lens, order, scheme, m, max_len)
            failed += ref is None
            assert (got is None) == (ref is None)
            if ref is None:
                continue
            checked += 1
            assert got[0] == ref[0] and got[1] == pytest.approx(ref[1], rel=1e-12)
            if scheme.pp > 1 and (scheme.a > 0 or scheme.b > 0):
                assert _lpt(lens, order, scheme, m, max_len, stop=ref[1] * (1 - 1e-9)) is None
                above = _lpt(lens, order, scheme, m, max_len, stop=ref[1] * (1 + 1e-9))
                assert above is not None and above[0] == ref[0]
    assert checked > 200 and failed > 20      # both outcomes exercised


def test_packing_greedy_fails_like_the_plain_loop_on_tight_steps():
    """Sequences near half the limit at the least counts: the greedy runs out of room late, which the fast
    path says at once (no micro-batch has room) -- as None, like the reference, never as a packing."""
    rng = np.random.default_rng(1)
    scheme = Scheme(1, 2, 4, 2e-9, 1.6e-4, 3e-4, 896)
    outcomes = set()
    for _ in range(6):
        lens = np.minimum(rng.lognormal(6.0, 0.6, 400).astype(np.int64) + 16, 882)
        order = np.argsort(-lens, kind="stable")
        m0 = -(-int(lens.sum()) // 896)
        for m in range(m0, m0 + 24, 3):
            ref = _greedy_reference(lens, scheme, m, 896)
            got = _lpt(lens, order, scheme, m, 896)
            outcomes.add(ref is None)
            assert (got is None) == (ref is None) and (ref is None or got[0] == ref[0])
    assert outcomes == {True, False}


def test_first_fit_matches_the_plain_loop():
    rng = np.random.default_rng(2)
    for _ in range(80):
        max_len = int(rng.choice([64, 896, 4096]))
        lens = _lengths(rng, int(rng.integers(0, 600)), max_len)
        assert pack_fixed(lens, max_len) == _first_fit_reference(lens, max_len)


def test_dispatch_greedy_matches_the_plain_loop():
    rng = np.random.default_rng(3)
    for _ in range(60):
        kinds = [_scheme(rng, int(rng.choice([512, 1024, 4096]))) for _ in range(int(rng.integers(1, 4)))]
        pipes = [kinds[int(rng.integers(0, len(kinds)))] for _ in range(int(rng.integers(1, 10)))]
        lens = _lengths(rng, int(rng.integers(0, 300)), max(s.max_len for s in pipes))
        np.testing.assert_array_equal(dispatch_greedy(pipes, lens), _dispatch_reference(pipes, lens))


def test_balanced_step_keeps_every_sequence_once_at_the_searchs_time():
    """A step of method 4 on two kinds of pipelines, one whose limit binds (the greedy fails at every count and
    first-fit packs it): every sequence once, within limits, each pipeline's packing the greedy's at one of the
    counts the search tries (`_lpt`, checked against the plain loop above) or the plain first-fit's."""
    rng = np.random.default_rng(4)
    short, long_ = Scheme(1, 2, 4, 2e-9, 1.6e-4, 3e-4, 896), Scheme(1, 4, 4, 1e-9, 8e-5, 3e-4, 11520)
    pipes = [short] + [long_] * 6
    lens = np.clip(rng.lognormal(7.0, 1.4, 2400).astype(np.int64), 16, 8192)
    plan = assign_step(METHODS[4], pipes, lens)
    assert sorted(i for p in plan for mb in p for i in mb) == list(range(lens.size))
    owner = dispatch_greedy(pipes, lens)
    branches = set()
    for p, s in enumerate(pipes):
        local = lens[owner == p]
        assert all(lens[mb].sum() <= s.max_len for mb in plan[p])
        mbs = pack_balanced(local, s)
        m0 = -(-int(local.sum()) // s.max_len)
        order = np.argsort(-local, kind="stable")
        found = [r[1] for m in range(m0, min(m0 + 20, local.size) + 1)
                 if (r := _lpt(local, order, s, m, s.max_len)) is not None]
        if found:
            assert any(pipeline_time(s, local, mbs) == pytest.approx(f, rel=1e-12) for f in found)
        else:
            assert mbs == _first_fit_reference(local, s.max_len)
        branches.add(bool(found))
    assert branches == {True, False}
