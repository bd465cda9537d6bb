"""Stage memory per pipeline (issue 40 item 4): the planner charges each pipeline's stages only what the runtime
has them hold.

The runtime (`cfp.runtime.engine`): pipeline 0's stages gather every pipeline's gradients, hold the optimizer state
and run the update; the other pipelines' stages hold their parameters and gradient accumulator and take pipeline
0's new parameters (`cfp.runtime.executor.broadcast_params`), compiling no update. So a stage of S parameter
bytes, O optimizer-state bytes and working set A peaks at 2 S + O + max(A, (N-1) S) on pipeline 0 and at
2 S + max(A, S) elsewhere. Checked here against what a two-pipeline `HeteroTrainer` places on each stage (`init`)
and against pipeline 0's compiled update program, not against the planner's own helpers; then that the planner
uses it: another pipeline's stage holds more layers than pipeline 0's of the same shape, and pipeline 0 is put
where the most memory is.
"""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from cfp.layout import Layout
from cfp.models import get_config
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel
from cfp.planner.step_features import Among, StepFeatures
from cfp.recompute import Recompute

CPU = parse_cluster({"inter_machine_bandwidth": "1GB/s",
                     "machines": [{"gpu": "cpu", "count": 8, "intra_bandwidth": "10GB/s"}]})
FULL = StepFeatures(recompute=Recompute.FULL)
SCALAR_SLACK = 16      # bytes: the update's float32 scale is the one argument the planner does not count
CFG = get_config("llama2", "tiny", num_layers=4, seq_len=32, hidden_size=64, num_heads=4, vocab_size=2048,
                 ffn_size=128)
# two pipelines, stages at TP 1 and 2: every place (first, middle, last) on both
LAYOUT = Layout.from_lists([[1, 1, 1], [1, 2, 1]], [[1, 2, 1], [1, 2, 1]], [8, 4], [4, 2])


def _held(tree) -> int:
    """Bytes one device holds of the arrays of `tree` (their shards)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(tree))


@pytest.fixture(scope="module")
def trainer():
    from cfp.models import make_batch
    from cfp.runtime.engine import zoo_trainer
    return zoo_trainer("llama2", CFG, LAYOUT, recompute=Recompute.FULL,
                       example_batch=make_batch("llama2", CFG, 1, 0)).init()


def _terms(cm, p, i):
    pipe = LAYOUT.pipelines[p]
    st = pipe.stages[i]
    return st, cm.memory_terms(st, i, pipe, Among(len(LAYOUT.pipelines), p == 0))


def test_each_pipelines_state_is_what_the_runtime_places(trainer):
    """Per stage of both pipelines, the planner's S and O at the stage's place against the parameters and the
    optimizer state the runtime placed on it: O is pipeline 0's alone (0 on pipeline 1, which holds none)."""
    cm = CostModel(CFG, CPU, features=FULL)
    assert set(trainer.opt_state) == {st.key for st in LAYOUT.placed_in(0)}
    for (p, i), params in trainer.params.items():
        st, t = _terms(cm, p, i)
        assert t.s0 + st.layers * t.s1 == _held(params), (p, i)
        held_opt = _held(trainer.opt_state.get((p, i), {}))
        assert abs(t.o0 + st.layers * t.o1 - held_opt) <= SCALAR_SLACK, ((p, i), t, held_opt)
        assert (held_opt > 0) == (p == 0)


def test_each_pipelines_peak_is_what_the_runtime_holds(trainer):
    """`stage_memory` per place: on pipeline 0 the larger of the backward (parameters, accumulator, optimizer
    state as placed, and the working set) and the compiled update program's arguments (its gradient from every
    pipeline, parameters, optimizer state); on pipeline 1 the larger of the backward and the broadcast
    (parameters, accumulator and pipeline 0's new parameters: three times the parameters placed)."""
    cm = CostModel(CFG, CPU, features=FULL)
    n = len(LAYOUT.pipelines)
    for (p, i), params in sorted(trainer.params.items()):
        pipe = LAYOUT.pipelines[p]
        st, t = _terms(cm, p, i)
        ws = t.a0 + st.layers * t.a1
        s, o = _held(params), _held(trainer.opt_state.get((p, i), {}))
        if p == 0:
            upd, args = trainer.compile_jobs((p, i))[3]
            update = upd.lower(*args).compile().memory_analysis().argument_size_in_bytes
            assert abs(update - ((1 + n) * s + o)) <= SCALAR_SLACK, ((p, i), update, s, o)
            want = max(2 * s + o + ws, update)
        else:
            want = max(2 * s + ws, 3 * s)
        got = cm.stage_memory(st, i, pipe, Among(n, p == 0))
        assert abs(got - want) <= 2 * SCALAR_SLACK, ((p, i), got, want)


def test_an_int_count_is_pipeline_0():
    """A plain pipeline count prices pipeline 0's place (what every caller that does not say gets)."""
    cm = CostModel(CFG, CPU, features=FULL)
    pipe = LAYOUT.pipelines[1]
    for i, st in enumerate(pipe.stages):
        assert cm.stage_memory(st, i, pipe, 2) == cm.stage_memory(st, i, pipe, Among(2, True))
        assert cm.stage_memory(st, i, pipe, Among(2, False)) < cm.stage_memory(st, i, pipe, 2)


def test_another_pipelines_stage_holds_more_layers():
    """On 24 GB devices a Llama-2 7B stage of pipeline 1 (no optimizer state, no gathered gradients) holds more
    layers than the same stage of pipeline 0; and the estimate of a layout charges its pipelines so."""
    from cfp.layout import Pipeline, Stage
    cluster = parse_cluster({"inter_machine_bandwidth": "10GB/s",
                             "machines": [{"gpu": "RTX3090", "count": 8, "intra_bandwidth": "32GB/s"}, {"gpu": "RTX3090", "count": 8, "intra_bandwidth": "32GB/s"}]})
    cm = CostModel(get_config("llama2", "7B"), cluster)
    st = Stage(tuple(range(4)), 8, 0)
    pipe = Pipeline((st, Stage(tuple(range(4, 8)), 24, 0)), 8, 8)
    first, other = (next(cm.layer_capacities(pipe, Among(2, u))) for u in (True, False))
    assert other > first >= 1
    lay = Layout.unchecked((pipe, Pipeline(tuple(Stage(tuple(d + 8 for d in s.devices), s.layers, 1)
                                                 for s in pipe.stages), 8, 8)))
    est = cm.estimate(lay)
    assert est.stages[1][0].memory < est.stages[0][0].memory


def test_the_planner_puts_pipeline_0_where_the_most_memory_is():
    """Of two pipelines on machines of 24 and 80 GB devices, pipeline 0 (the optimizer state's) is the 80 GB
    one whatever the cluster file's order."""
    from cfp.planner.options import PlannerOptions
    from cfp.planner.planner import _Search
    cluster = parse_cluster({"inter_machine_bandwidth": "10GB/s",
                             "machines": [{"gpu": "RTX3090", "count": 8, "intra_bandwidth": "32GB/s"}, {"gpu": "A100-SXM-80G", "count": 8, "intra_bandwidth": "300GB/s"}]})
    cm = CostModel(get_config("llama2", "7B"), cluster)
    search = _Search(cm, PlannerOptions(global_batch_size=64))
    groups = [list(range(8)), list(range(8, 16))]
    assert search.pipeline_zero_first(groups) == [groups[1], groups[0]]
    assert search.pipeline_zero_first(groups[::-1]) == [groups[1], groups[0]]


def test_the_gradient_sync_is_pipeline_0s():
    """Only pipeline 0's stages gather the gradients (`cfp.runtime.executor.sync_gradients`): the sync time
    follows pipeline 0's stage bounds (a stage syncs its layers one after another), not another pipeline's."""
    from cfp.layout import Pipeline, Stage
    cluster = parse_cluster({"inter_machine_bandwidth": "10GB/s", "machines": [
        {"gpu": "A100-SXM-80G", "count": 8, "intra_bandwidth": "300GB/s"}] * 2})
    cm = CostModel(get_config("llama2", "small", num_layers=4), cluster)
    split = lambda m, layers: tuple(Stage((8 * m + i,), n, m) for i, n in enumerate(layers))
    dp = lambda a, b: cm.estimate(Layout.unchecked((Pipeline(split(0, a), 8, 4), Pipeline(split(1, b), 8, 4)))).dp_time
    assert dp((2, 2), (4,)) == pytest.approx(dp((2, 2), (2, 2)))
    assert dp((4,), (2, 2)) > 1.5 * dp((2, 2), (2, 2))
