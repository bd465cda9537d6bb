"""Reference plans verified next to the DP's best: data parallel, and DP x TP that recovers Megatron."""
import jax

from cfp.analysis.analysis import analyze
from cfp.analysis.blocks import data_parallel_choice
from cfp.models import get_config, train_step
from cfp.search.uniform import dp_tp_choice


def _analysis(mesh):
    ts = train_step("gpt", get_config("gpt", "tiny", num_layers=1))
    params, opt = jax.eval_shape(ts.init, jax.random.PRNGKey(0))
    return analyze(ts.step, params, opt, ts.make_batch(8, jax.random.PRNGKey(1)), mesh=mesh)


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
