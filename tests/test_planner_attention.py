"""The planner prices the attention cfp's runtime would run on the cluster's GPUs (issue 39 item 2): the
chooser's decision (`cfp.models.attention_select`) for each catalog GPU's compute capability, the config's dtype
and head dim; fused attention writes no scores, materialised attention its float32 scores' softmax passes."""
import pytest

from cfp.errors import ConfigError
from cfp.hardware.gpus import GPUS
from cfp.models import get_config
from cfp.models.attention_select import DeviceKind
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import find_layout
from cfp.planner.step_features import StepFeatures, device_kind, runtime_fuses_attention


def _cluster(*gpus):
    return parse_cluster({"inter_machine_bandwidth": "10GB/s", "machines": [
        {"gpu": g, "count": 2, "intra_bandwidth": "25GB/s"} for g in gpus]})


LLAMA_BF16 = get_config("llama2", "tiny", dtype="bfloat16", num_layers=4)      # head dim 16


@pytest.mark.parametrize("gpus,config,fused", [
    (("A100-SXM-80G",), LLAMA_BF16, True),
    (("H100-SXM",), LLAMA_BF16, True),
    (("RTX3090", "RTX4090"), LLAMA_BF16, True),                   # two kinds, both fused
    (("V100-SXM2-32G",), LLAMA_BF16, False),                      # before Ampere
    (("A100-SXM-80G", "V100-SXM2-32G"), LLAMA_BF16, False),       # kinds that differ: materialised everywhere
    (("cpu",), LLAMA_BF16, False),
    (("A100-SXM-80G",), get_config("llama2", "tiny", num_layers=4), False),                  # float32
    (("A100-SXM-80G",), get_config("bert", "tiny", dtype="bfloat16", num_layers=4), False),  # bidirectional
], ids=str)
def test_the_planner_prices_the_runtimes_choice(gpus, config, fused):
    cluster = _cluster(*gpus)
    assert runtime_fuses_attention(config, cluster) is fused
    cm = CostModel(config, cluster)
    assert cm.model.fused_attention is fused
    # the score traffic is what a fused kernel removes: priced exactly where the runtime materialises scores
    assert (cm.model.layer_score_bytes(1) == 0) is fused
    # an explicit feature still wins (the published runs of other systems are priced with their own)
    for given in (True, False):
        assert CostModel(config, cluster, features=StepFeatures(fused_attention=given)).model.fused_attention \
            is given


def test_a_fused_gpu_is_planned_faster_than_materialised_scores():
    """find_layout's estimate on an A100 cluster is the fused pricing's, and faster than materialised scores."""
    cfg = get_config("llama2", "tiny", dtype="bfloat16", num_layers=4, seq_len=512)
    cluster = _cluster("A100-SXM-80G")
    options = PlannerOptions(global_batch_size=8)
    r = find_layout(cluster, cfg, options)
    fused = CostModel(cfg, cluster, options.schedule, features=StepFeatures(fused_attention=True))
    scores = CostModel(cfg, cluster, options.schedule, features=StepFeatures(fused_attention=False))
    assert r.estimate.step_time == pytest.approx(fused.estimate(r.layout).step_time, rel=1e-12)
    assert scores.estimate(r.layout).step_time > r.estimate.step_time


def test_catalog_device_kinds():
    assert device_kind(GPUS["cpu"]) == DeviceKind("cpu")
    assert device_kind(GPUS["H100-SXM"]) == DeviceKind("gpu", (9, 0))
    assert device_kind(GPUS["RTX4090"]) == DeviceKind("gpu", (8, 9))
    assert all(g.compute_capability for n, g in GPUS.items() if n != "cpu")     # every catalog GPU is CUDA
    with pytest.raises(ConfigError, match="compute_capability"):
        GPUS["L4"].__class__(**{**GPUS["L4"].__dict__, "compute_capability": (8,)})
