"""`cfp.data.rescale`: per-scheme factors learned from measured pipeline spans, and the per-step choice they
steer. No JAX program runs: the measured spans are made up from a known true scale of each scheme."""
import numpy as np
import pytest

from cfp.data.batching import METHODS, assign_step
from cfp.data.breakdown import PipelineTime
from cfp.data.rescale import BOUNDS, DAMPING, scaled, updated
from cfp.data.packing import pipeline_time
from cfp.data.schemes import CostForm, Scheme
from cfp.data.train import DataTrainOptions, plan_step

ONE = Scheme(1, 1, 1, 2e-9, 3e-6, 4e-3, 1024, CostForm.ROWS)
TWO = Scheme(1, 2, 1, 1.8e-9, 2.7e-6, 3.6e-3, 1024, CostForm.ROWS)
LENS = np.array([900, 800, 500, 500, 300, 200, 120, 100, 60, 40])


def _time(span: float, estimated: float) -> PipelineTime:
    return PipelineTime(pipeline=0, devices=1, host=0.0, real=span, padding=0.0, cross=0.0, overhead=0.0,
                        bubble=0.0, idle=0.0, sync=0.0, span=span, estimated_span=estimated)


def test_a_scaled_scheme_prices_every_micro_batch_by_its_factor():
    (one, two), = scaled([[ONE, TWO]], {(1, 1, 1): 1.7})
    assert two is TWO                                  # no factor: the fit as measured
    for lengths in ([100], [200, 150, 90, 30], [1000]):
        assert one.mb_cost(lengths) == pytest.approx(1.7 * ONE.mb_cost(lengths), rel=1e-12)


def test_a_factor_moves_halfway_in_log_scale_toward_the_median_ratio_and_stays_bounded():
    f = updated({}, [ONE, ONE, ONE, TWO], [_time(3.0, 1.0), _time(5.0, 1.0), _time(4.0, 1.0), _time(0.0, 1.0)])
    assert f == {(1, 1, 1): pytest.approx(4.0 ** DAMPING)}   # TWO computed nothing: no evidence, no factor
    f = updated({(1, 1, 1): 1.5, (1, 2, 1): 0.8}, [TWO], [_time(1.0, 2.0)])
    assert f == {(1, 1, 1): 1.5, (1, 2, 1): pytest.approx(0.8 * 0.5 ** DAMPING)}
    f = {}
    for _ in range(40):   # a scheme 100x slower than its fit: the factor stops at the bound
        f = updated(f, [ONE], [_time(100.0, 1.0)])
    assert f[(1, 1, 1)] == BOUNDS[1]


def test_factors_learned_from_measured_spans_reach_the_true_scale_and_change_the_choice():
    """The fits rate [ONE, ONE] fastest; measured, ONE runs 2x and TWO 0.9x their fits. Steps priced with the
    learned factors switch to [TWO], as the true times say they should, and TWO's factor converges on its scale."""
    truth = {(1, 1, 1): 2.0, (1, 2, 1): 0.9}
    opts = DataTrainOptions("llama2", METHODS[4], 1, 100)
    cands = [[ONE, ONE], [TWO]]
    k0, *_ = plan_step(opts, cands, LENS)
    assert k0 == 0
    true_est = [max(pipeline_time(s, LENS, mbs) * truth[(s.cp, s.tp, s.pp)]
                    for s, mbs in zip(c, assign_step(METHODS[4], c, LENS))) for c in cands]
    assert true_est[1] < true_est[0]
    factors, chosen = {}, []
    for _ in range(12):
        k, _, _, spans = plan_step(opts, scaled(cands, factors), LENS)
        chosen.append(k)
        measured = [_time(sp / factors.get((s.cp, s.tp, s.pp), 1.0) * truth[(s.cp, s.tp, s.pp)], sp)
                    for s, sp in zip(cands[k], spans)]
        factors = updated(factors, cands[k], measured)
    assert chosen[0] == 0 and chosen[-1] == 1
    assert 1.5 < factors[(1, 1, 1)] <= 2.0 + 1e-9   # learned while it ran, kept once the choice left it
    assert factors[(1, 2, 1)] == pytest.approx(0.9, rel=0.05)


def test_every_process_prices_the_next_step_with_process_0s_factors(monkeypatch):
    """Each process measures only the pipelines it runs (the others' spans are 0 there), so its own factors differ;
    `next_factors` hands every process process 0's (an all-gather over the candidates' shapes, in one order
    whatever factors a process holds), so all choose the same mix and enter the same collectives."""
    import dataclasses
    import types

    import jax

    import cfp.runtime.host_state as host_state
    from cfp.data import train
    gathered = []

    def allgather(x):       # process 0 measured pipeline 0 only: its factor for (1, 1, 1) moved, (1, 2, 1)'s not
        gathered.append(np.asarray(x))
        return np.stack([np.array([1.5, 1.0], np.float32), np.asarray(x)])
    monkeypatch.setattr(host_state, "process_allgather", allgather)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    opts = DataTrainOptions(model="llama2", method=METHODS[4], steps=2, tokens_per_step=1000)
    # this process ran pipeline 1 only: (1, 2, 1) measured 2x its estimate, (1, 1, 1) not at all
    rec = types.SimpleNamespace(mix=0, pipelines=(_time(0.0, 1.0), _time(2.0, 1.0)))
    assert updated({}, [ONE, TWO], rec.pipelines) == {(1, 2, 1): pytest.approx(2.0 ** DAMPING)}  # its own view
    got = train.next_factors(opts, {}, [[ONE, TWO]], rec)
    assert got == {(1, 1, 1): pytest.approx(1.5)}          # process 0's, (1, 2, 1) at 1 there
    assert [g.tolist() for g in gathered] == [[1.0, pytest.approx(2.0 ** DAMPING)]]   # sorted shapes: (1,1,1), (1,2,1)
    assert train.next_factors(dataclasses.replace(opts, recalibrate=False), {}, [[ONE, TWO]], rec) == {}
