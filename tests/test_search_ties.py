"""Reproducible choice: plans within the measured noise of the fastest are tied, and ties go to memory, then
communication, then the choice itself, whatever order the candidates were verified in."""
import itertools

import pytest

from cfp.errors import ConfigError, InfeasibleError
from cfp.search.options import SearchOptions
from cfp.search.search import SearchResult, VerifiedChoice, _best_fitting


def _v(choice, time, memory, noise=0.05, comm=0):
    return VerifiedChoice(tuple(choice), (), time, time, memory, 1e9, noise, comm)


def _result(verified, best, budget=None):
    return SearchResult(best.choice, best.shard_state, best, tuple(verified), 1.0, budget, 0.0)


def test_within_noise_the_leaner_plan_wins_in_any_order():
    fast, lean, far = _v([1, 1], 1.00e-3, 900), _v([0, 0], 1.03e-3, 500), _v([2, 2], 1.50e-3, 100)
    for order in itertools.permutations([fast, lean, far]):
        assert _best_fitting(list(order), SearchOptions()) == lean
    text = _result([fast, lean, far], lean).margin_text()
    assert ("chosen plan (searched): 1.03 ms measured; runner-up (searched) 1 ms (-2.9%, within measured noise "
            "±5.0%)") == text


def test_outside_noise_the_fastest_wins_and_margin_says_so():
    fast, lean = _v([1, 1], 1.00e-3, 900, noise=0.01), _v([0, 0], 1.10e-3, 500, noise=0.01)
    best = _best_fitting([lean, fast], SearchOptions())
    assert best == fast
    assert "(+10.0%, outside measured noise ±1.0%)" in _result([lean, fast], best).margin_text()


def test_exact_ties_break_by_communication_then_choice():
    a, b, c = _v([0, 1], 1e-3, 500, 0.0, comm=10), _v([1, 0], 1e-3, 500, 0.0, comm=5), _v([0, 0], 1e-3, 500, 0.0, 5)
    for order in itertools.permutations([a, b, c]):
        assert _best_fitting(list(order), SearchOptions()) == c


def test_estimates_tie_only_when_equal_and_budget_still_binds():
    fast, lean = _v([1], 1.000e-3, 900, noise=None), _v([0], 1.001e-3, 500, noise=None)
    assert _best_fitting([lean, fast], SearchOptions()) == fast
    assert "estimated" in _result([lean, fast], fast).margin_text()
    assert _best_fitting([lean, fast], SearchOptions(memory_per_device=600)) == lean
    with pytest.raises(InfeasibleError):
        _best_fitting([lean, fast], SearchOptions(memory_per_device=100))


def test_a_baseline_chosen_over_a_faster_timed_plan_says_why():
    """When the tie rule gives a plain layout the win over a searched plan timed faster within the noise,
    the report says so (it once printed a faster searched plan as if it had lost)."""
    fast, lean = _v([1, 1], 1.00e-3, 900), _v([0, 0], 1.03e-3, 500)
    res = SearchResult(lean.choice, (), lean, (fast, lean), 1.0, None, 0.0, baseline="FSDP", searched=fast)
    assert res.baseline_text() == ("chosen plan is the FSDP baseline: the fastest searched plan [1, 1] took 1 ms "
                                   "(measured) vs 1.03 ms, within the measured noise; the tie went to the least "
                                   "memory (500 B vs 900 B per device)")
    slow = _v([1, 1], 1.2e-3, 900)
    res = SearchResult(lean.choice, (), lean, (slow, lean), 1.0, None, 0.0, baseline="FSDP", searched=slow)
    assert res.baseline_text().endswith("took 1.2 ms (measured) vs 1.03 ms")


def test_time_label_follows_how_the_times_were_taken():
    from cfp.profiling.options import ProfilerKind, ProfilerSpec
    timed, summed = _v([0, 0], 1e-3, 500), _v([0, 0], 1e-3, 500, noise=None)
    measure, estimate = ProfilerSpec(ProfilerKind.MEASURE), ProfilerSpec(ProfilerKind.ESTIMATE, "H100-SXM")
    label = lambda v, p: SearchResult(v.choice, (), v, (v,), 1.0, None, 0.0, profiler=p).time_label
    assert label(timed, measure) == "measured"
    # verify=0: the DP's sum of measured segment profiles is an estimate of the whole step, never "measured"
    assert label(summed, measure) == "estimated: segment profiles summed by the DP, not timed whole"
    assert label(summed, estimate) == "estimated: H100-SXM cost model"
    assert "measured" not in SearchResult(summed.choice, (), summed, (summed,), 1.0, None, 0.0,
                                          profiler=measure).report()


def test_side_by_side_rounds_stop_at_the_timing_budget():
    """Rounds past the first `min_rounds` stop once the timed runs took `budget` seconds (a deep model's slow
    step is timed fewer times); without a budget, or within it, every round runs."""
    from cfp.xla.compiled import time_in_turns
    calls = [0, 0]

    def prepare(k):
        def run():
            calls[k] += 1
            return 0
        return run
    for budget, want in ((None, 10), (1e6, 10), (0.0, 3)):
        calls[:] = [0, 0]
        timed = time_in_turns([lambda: prepare(0), lambda: prepare(1)], 10, 2, budget, min_rounds=3)
        assert calls == [2 + want] * 2 and len(timed) == 2
    with pytest.raises(ConfigError, match="timing_budget"):
        SearchOptions(timing_budget=0)
