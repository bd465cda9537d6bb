"""The planner cost model's step features (`cfp.planner.step_features`): recomputation, fused attention, the
all-reduce and sharded (FSDP) gradient syncs, overlap -- each checked against a hand-derived figure (ring
collective formulas, the model's own parameter tree, the attention scores' bytes), not against itself."""
import math

import jax
import jax.numpy as jnp
import pytest

from cfp.errors import ConfigError
from cfp.models import build_model, get_config
from cfp.costs import ModelCost
from cfp.planner.cluster import parse_cluster
from cfp.layout import Layout, Pipeline, Stage
from cfp.planner.costmodel import CostModel
from cfp.planner.step_features import GradSync, Recompute, StepFeatures

BW = 300e9
GPUS = parse_cluster({"inter_machine_bandwidth": "25GB/s", "machines": [
    {"gpu": "A100-SXM-80G", "count": 8, "intra_bandwidth": "300GB/s"}]})


def _pipe(tp: int, layers: tuple[int, ...], batch: int, chunks: int, first_device: int = 0) -> Pipeline:
    stages, nxt = [], first_device
    for n in layers:
        stages.append(Stage(tuple(range(nxt, nxt + tp)), n, 0))
        nxt += tp
    return Pipeline(tuple(stages), batch, chunks)


def _tree_params(cfg) -> int:
    """Every parameter of the model, counted from its own tree (nothing allocated)."""
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
    like = jax.eval_shape(build_model("gpt", cfg).init, jax.random.PRNGKey(0), tokens)
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(like))


@pytest.fixture(scope="module")
def cfg():
    return get_config("gpt", "small", dtype="bfloat16")


@pytest.mark.parametrize("tp", [1, 2])
def test_backward_is_three_forwards_with_recompute_and_two_without(cfg, tp):
    pipe = _pipe(tp, (1, 2, 1), 8, 4)
    mid = pipe.stages[1]                         # no embedding, no head: layers and their all-reduces only
    # Megatron's two all-reduces per layer and pass: ring, 2(n-1)/n of the activation, at the machine's bandwidth
    ar = 2 * 2 * (tp - 1) / tp * 2 * cfg.seq_len * cfg.hidden_size * 2 / BW
    est = {}
    for rc in Recompute:
        cm = CostModel(cfg, GPUS, features=StepFeatures(recompute=rc))
        est[rc] = cm.stage_estimate(mid, 1, pipe, 1, pipe.stages[2])
    compute = est[Recompute.FULL].fwd - mid.layers * ar
    assert est[Recompute.NONE].fwd == pytest.approx(est[Recompute.FULL].fwd)
    assert est[Recompute.FULL].bwd == pytest.approx(3 * compute + 2 * mid.layers * ar)
    assert est[Recompute.NONE].bwd == pytest.approx(2 * compute + mid.layers * ar)
    assert est[Recompute.NONE].flops_bwd == pytest.approx(2 / 3 * est[Recompute.FULL].flops_bwd)


def test_without_recompute_every_stored_micro_batch_keeps_its_activations(cfg):
    pipe = _pipe(1, (2, 2), 8, 4)                 # GPipe keeps all 4 micro-batches' inputs
    full = CostModel(cfg, GPUS, features=StepFeatures(recompute="full")).memory_terms(pipe.stages[0], 0, pipe, 1)
    none = CostModel(cfg, GPUS, features=StepFeatures(recompute="none")).memory_terms(pipe.stages[0], 0, pipe, 1)
    assert none[3] == pytest.approx(4 * full[3]) and none[:3] == full[:3]


def test_fused_attention_drops_the_score_traffic_not_the_flops(cfg):
    plain, fused = ModelCost(cfg), ModelCost(cfg, fused_attention=True)
    scores = cfg.num_heads * cfg.seq_len ** 2 * 4          # float32 scores of one sequence and layer
    assert plain.layer_elementwise_bytes(1) - fused.layer_elementwise_bytes(1) == pytest.approx(4 * scores)
    assert plain.layer_activation_bytes(1) - fused.layer_activation_bytes(1) == pytest.approx(3 * scores)
    assert plain.layer_gemms(1, 2) == fused.layer_gemms(1, 2)
    with pytest.raises(ConfigError, match="fused_attention='yes'"):
        ModelCost(cfg, fused_attention="yes")


def _data_parallel(n: int, chunks: int = 1) -> Layout:
    return Layout(tuple(_pipe(1, (4,), 2 * chunks, chunks, first_device=i) for i in range(n)))


def test_all_reduce_sync_is_a_ring_all_reduce_of_every_gradient(cfg):
    n, params = 4, _tree_params(cfg)
    for grad_bytes in (2, 4):
        cm = CostModel(cfg, GPUS, features=StepFeatures(grad_sync=GradSync.ALL_REDUCE, grad_bytes=grad_bytes))
        want = 2 * (n - 1) / n * params * grad_bytes / BW
        assert cm.dp_time(_data_parallel(n)) == pytest.approx(want, rel=1e-9)


def test_sharded_sync_gathers_per_micro_batch_and_shards_the_state(cfg):
    n, chunks, params = 4, 3, _tree_params(cfg)
    lay = _data_parallel(n, chunks)
    plain = CostModel(cfg, GPUS, features=StepFeatures(grad_sync=GradSync.ALL_REDUCE))
    fsdp = CostModel(cfg, GPUS, features=StepFeatures(grad_sync=GradSync.SHARDED))
    gathers = 2 * chunks * (n - 1) / n * params * 2 / BW           # bfloat16 parameters, forward and backward
    scatter = (n - 1) / n * params * 4 / BW                        # float32 gradients
    assert fsdp.dp_time(lay) == pytest.approx(gathers + scatter, rel=1e-9)
    assert fsdp.update_time(lay) == pytest.approx(plain.update_time(lay) / n)
    st, pipe = lay.pipelines[0].stages[0], lay.pipelines[0]
    s_plain, s_fsdp = plain.memory_terms(st, 0, pipe, n), fsdp.memory_terms(st, 0, pipe, n)
    assert s_fsdp[0] == pytest.approx(s_plain[0] / n) and s_fsdp[1] == pytest.approx(s_plain[1] / n)


def test_overlapped_sync_hides_under_compute(cfg):
    lay = _data_parallel(4)
    for overlap in (False, True):
        cm = CostModel(cfg, GPUS, features=StepFeatures(grad_sync="all-reduce", overlap_grad_sync=overlap))
        e = cm.estimate(lay)
        compute = max(e.pipeline_time)
        want = (max(compute, e.dp_time) if overlap else compute + e.dp_time) + e.update_time
        assert e.dp_time > 0 and e.step_time == pytest.approx(want)


@pytest.mark.parametrize("kwargs, needle", [
    ({"recompute": "some"}, "recompute='some'"),
    ({"grad_sync": "ring"}, "grad_sync='ring'"),
    ({"grad_bytes": 3}, "grad_bytes=3"),
    ({"overlap_grad_sync": 1}, "overlap_grad_sync=1"),
])
def test_step_feature_errors_name_the_value(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        StepFeatures(**kwargs)
    assert needle in str(e.value)


def test_gather_sync_moves_and_reads_each_other_pipelines_gradient_once(cfg):
    """The runtime's sync (`GradSync.GATHER`): every stage gathers the other n - 1 pipelines' float32 gradients
    over the link, and its update program reads them beside its own (the sum is fused into AdamW, whose
    reads `update_time` prices): (n - 1) P 4 bytes over the link and (n - 1) P 4 more from memory."""
    n, params = 4, _tree_params(cfg)
    gpu = GPUS.machines[0].gpu
    want = (n - 1) * params * 4 / BW + (n - 1) * params * 4 / (gpu.mem_gbps * 1e9)
    assert CostModel(cfg, GPUS).dp_time(_data_parallel(n)) == pytest.approx(want, rel=1e-9)


def test_a_stage_beyond_the_cache_runs_its_memory_bound_work_at_the_spilled_rate():
    """`GpuSpec.spill` (the `cpu` entry's): a stage whose one micro-batch's activations exceed the cache
    prices its elementwise bytes (the softmax passes aside) at the spilled rate; below it nothing changes.
    Checked against the same cluster without a cache term, at the micro-batches either side of it."""
    import dataclasses
    cfg = get_config("llama2", "small", num_layers=4)
    cpu = parse_cluster({"inter_machine_bandwidth": "1GB/s",
                         "machines": [{"gpu": "cpu", "count": 8, "intra_bandwidth": "10GB/s"}]})
    gpu = cpu.machines[0].gpu
    plain = dataclasses.replace(cpu, machines=(dataclasses.replace(
        cpu.machines[0], gpu=dataclasses.replace(gpu, spill=None)),))
    m = ModelCost(cfg)
    layers, (cache, spilled_gbps) = 2, gpu.spill
    per_seq = layers * m.layer_activation_bytes(1)
    below = int(cache // per_seq)
    assert below >= 1, "the calibrated cache holds one sequence's activations of two layers"
    for mb in (below, below + 1):
        pipe = _pipe(1, (1, layers, 1), 2 * mb, 2)
        est = [CostModel(cfg, c, features=StepFeatures(recompute="full")).stage_estimate(
            pipe.stages[1], 1, pipe, 1, pipe.stages[2]) for c in (cpu, plain)]
        extra = 4 * layers * mb * (m.layer_elementwise_bytes(1) - m.layer_score_bytes(1)) * (
            1 / (spilled_gbps * 1e9) - 1 / (gpu.mem_gbps * 1e9))      # forward + recomputed forward + backward
        want = 0.0 if mb == below else extra
        assert (est[0].fwd + est[0].bwd) - (est[1].fwd + est[1].bwd) == pytest.approx(want, abs=1e-12, rel=1e-9)
