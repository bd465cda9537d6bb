"""Reference plans verified next to the DP's best: data parallel, and DP x TP that recovers Megatron."""
import jax
import pytest

from cfp.analysis.analysis import analyze, analyze_with_program
from cfp.sharding.step import apply_choice
from cfp.xla.hlo import parse_collectives
from cfp.analysis.blocks import data_parallel_choice
from cfp.models import get_config, train_step
from cfp.baselines.handwritten import Baseline, baseline_step
from cfp.baselines.uniform import dp_tp_choice


def _analysis(mesh):
    ts = train_step("gpt", get_config("gpt", "tiny", num_layers=1))
    params, opt = jax.eval_shape(ts.init, jax.random.PRNGKey(0))
    return analyze(ts.step, mesh, params, opt, ts.make_batch(8, jax.random.PRNGKey(1)))


def test_data_parallel_choice_shards_the_batch_everywhere():
    a = _analysis("2x4")
    for b, c in zip(a.blocks, data_parallel_choice(a.graph, a.blocks)):
        assert a.notation(b.index, c).split(" = ")[0].startswith("S")
        assert a.notation(b.index, c).endswith("@ {01}")


def test_dp_tp_choice_is_megatron_on_a_2d_mesh():
    a = _analysis("2x4")
    choice = dp_tp_choice(a)
    text = {"/".join(b.scope[-2:]): a.notation(b.index, c) for b, c in zip(a.blocks, choice)}
    assert text["attn/query"] == "SRSR = SRR x RSR @ {0,1}"          # column parallel over heads
    assert text["attn/out"].endswith("(allreduce @ 1)")                # row parallel
    assert text["mlp/fc_in"] == "SRS = SRR x RS @ {0,1}"               # column parallel
    assert text["mlp/fc_out"] == "SRR = SRS x SR @ {0,1} (allreduce @ 1)"   # row parallel
    assert dp_tp_choice(_analysis("8")) is None


@pytest.mark.parametrize("model,mesh", [("gpt", "2x4"), ("llama2", "8"), ("llama2", "2x4"), ("moe", "2x4")])
def test_data_parallel_choice_compiles_to_the_data_parallel_baseline(model, mesh):
    # the same collectives as jax.jit with hand-written data-parallel shardings: one gradient all-reduce
    # (and the loss's); nothing where analysis lost track of the batch dim (RoPE's split/pad, the loss's
    # gather, MoE's transposed expert inputs)
    ts = train_step(model, get_config(model, "tiny", num_layers=1))
    params, opt = jax.jit(ts.init)(jax.random.PRNGKey(0))
    args = (params, opt, ts.make_batch(8, jax.random.PRNGKey(1)))
    a, program = analyze_with_program(ts.step, mesh, *args)
    sharded = apply_choice(program, a, data_parallel_choice(a.graph, a.blocks))
    found = sorted((c.kind, c.bytes) for c in sharded.collectives(*args))
    fn, shardings = baseline_step(Baseline.DATA_PARALLEL, ts.step, args, sharded.mesh)
    placed = jax.device_put(args, shardings)
    expected = sorted((c.kind, c.bytes) for c in parse_collectives(fn.lower(*placed).compile().as_text(),
                                                                  a.mesh.shape))
    assert found == expected
