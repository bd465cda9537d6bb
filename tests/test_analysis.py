"""Analysis pass on the model zoo: block coverage, forward/backward fusion, segments, serialisation."""
import functools

import jax
import pytest

from cfp.analysis.analysis import Analysis, analyze
from cfp.analysis.blocks import DotRole, trace_view
from cfp.analysis.strategies import LoopKind, dot_loops, enumerate_strategies
from cfp.ir.graph import DotDims
from cfp.models import get_config, train_step


@functools.lru_cache(maxsize=None)
def _analysis(model: str, layers: int, mesh: str = "8", batch: int = 8) -> Analysis:
    ts = train_step(model, get_config(model, "tiny", num_layers=layers))
    params, opt = jax.eval_shape(ts.init, jax.random.PRNGKey(0))  # analysis needs shapes, not values
    return analyze(ts.step, mesh, params, opt, ts.make_batch(batch, jax.random.PRNGKey(1)))


@pytest.mark.parametrize("model", ["gpt", "llama2", "moe", "bert"])
def test_every_operator_in_exactly_one_block_or_remainder(model):
    a = _analysis(model, 2)
    seen = [i for b in a.blocks for i in b.operators] + list(a.remainder)
    assert sorted(seen) == list(range(len(a.graph.operators)))
    assert len(a.remainder) < 0.02 * len(a.graph.operators)  # the remainder is small scalar bookkeeping
    for b in a.blocks:
        assert all(a.graph.operators[d.op].is_dot for d in b.dots)
        assert b.dots[0].role is DotRole.FORWARD and len(b.strategies) >= 2


def _weights(a: Analysis):
    """Flat inputs of the step that are parameters (paths under [0]) with >= 2 dims."""
    g = a.graph
    return [(t, p) for t, p in zip(g.inputs, g.input_paths) if p.startswith("[0]") and len(g.tensor(t).shape) >= 2
            and "embed" not in p and "bias" not in p]


@pytest.mark.parametrize("model", ["gpt", "llama2", "moe"])
def test_each_weight_fuses_forward_and_weight_gradient(model):
    """The dot reading a weight and the dot producing its gradient are in the same block, fully re-indexed."""
    a = _analysis(model, 2)
    g = a.graph
    weights = _weights(a)
    assert len(weights) >= 6
    for t, path in weights:
        fwd = [op for op in g.dots if not op.backward and any(trace_view(g, x)[0] == t for x in op.inputs[:2])]
        assert fwd, f"no forward dot reads {path}"
        block = next(b for b in a.blocks if b.forward.op == fwd[0].index)
        shape = g.tensor(t).shape
        grads = [d for d in block.dots if d.role is DotRole.BACKWARD
                 and sorted(g.tensor(g.operators[d.op].outputs[0]).shape) == sorted(shape)]
        assert grads, f"{path}: no weight-gradient dot in block {block.index}"
        for d in block.dots:
            assert None not in d.loop_map, f"{path}: dot {d.op} not fully re-indexed: {d.loop_map}"


@pytest.mark.parametrize("model", ["gpt", "llama2"])
def test_unique_segments_do_not_grow_with_layers(model):
    counts = {L: _analysis(model, L).num_unique_segments for L in (2, 4, 8)}
    assert len(set(counts.values())) == 1, counts
    a = _analysis(model, 4)
    layer_segments = [s for s in a.segments if s.stop - s.start > 1]
    assert len(layer_segments) == 4 and len({s.kind for s in layer_segments}) == 1
    assert all(s.mapped_to == (layer_segments[0].start, layer_segments[0].stop) for s in layer_segments)


def test_moe_layers_form_their_own_segment_kind():
    a = _analysis("moe", 4)
    kinds = [s.kind for s in a.segments]
    # dense, moe, dense, moe, head: two layer kinds alternate
    assert kinds[0] == kinds[2] and kinds[1] == kinds[3] and kinds[0] != kinds[1]
    assert a.num_unique_segments == 3


def test_analysis_json_round_trip():
    a = _analysis("gpt", 2, mesh="2x4")
    b = Analysis.from_json(a.to_json())
    assert b == a
    assert b.notation(0, 0) == a.notation(0, 0)


def test_strategy_notation_matches_alpa_style():
    loops = dot_loops((64, 32), (32, 16), DotDims((1,), (0,), (), ()))
    assert [l.kind for l in loops] == [LoopKind.LHS_FREE, LoopKind.RHS_FREE, LoopKind.CONTRACT]
    strategies = enumerate_strategies(loops, (2, 4))
    text = {s.notation(loops, 2, 2, 2) for s in strategies}
    assert "SS = SR x RS @ {0,1}" in text            # m on axis 0, n on axis 1: no communication
    assert "RS = RS x SS @ {1,0} (allreduce @ 1)" in text   # k on axis 1, n on axis 0
    assert "SR = SR x RR @ {01}" in text             # data parallel over the whole mesh
    assert len(strategies) == 9                       # 3 loops per axis, all divisible
    one_d = enumerate_strategies(loops, (8,))
    assert len(one_d) == 3


def test_indivisible_loops_are_not_offered():
    loops = dot_loops((6, 5), (5, 3), DotDims((1,), (0,), (), ()))
    assert enumerate_strategies(loops, (4,))[0].loop_of_axis == (None,)   # nothing divides: replicated only


@pytest.mark.parametrize("model", ["gpt", "llama2", "moe", "bert"])
def test_backward_dots_map_forward_loops_one_to_one(model):
    # a forward operand read through a transpose (MoE's egcm,emf->egcf) must not fold two loops into one
    a = _analysis(model, 2)
    for b in a.blocks:
        for d in b.dots[1:]:
            mapped = [fl for fl in d.loop_map if fl is not None]
            assert len(mapped) == len(set(mapped)), (b.index, d.op, d.loop_map)
