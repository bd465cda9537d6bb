"""Heterogeneous-cluster planner: cluster files, the cost model (against parameter trees and the
runtime's compiled stages), plan properties on random clusters, the exhaustive optimum, layout files."""
import itertools
import random

import jax
import numpy as np
import pytest

from cfp.errors import ConfigError
from cfp.layout import Layout, Pipeline, Stage
from cfp.models import get_config
from cfp.models.layered import zoo_model
from cfp.planner.build import allocate_chunks, max_chunks, split_layers
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel
from cfp.planner.exhaustive import exhaustive_layout
from cfp.planner.layout_file import load_layout_file
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import find_layout
from cfp.planner.random_clusters import optimality_case, random_cluster
from cfp.runtime.sharding import param_specs
from cfp.schedules.registry import ScheduleName

LOCAL = {"inter_machine_bandwidth": "1.75GB/s",
         "machines": [{"gpu": "cpu", "count": 8, "intra_bandwidth": "1.75GB/s"}]}


# ----------------------------------------------------------------------------- cluster files
def test_cluster_units_repeat_and_memory_override():
    cl = parse_cluster({"inter_machine_bandwidth": "10Gb/s", "machines": [
        {"gpu": "rtx 4090", "count": 4, "intra_bandwidth": "25GB/s", "repeat": 2},
        {"gpu": "A100-SXM-80G", "count": 8, "intra_bandwidth": "300 GB/s", "memory": "40GiB"}]})
    assert cl.num_devices == 16 and len(cl.machines) == 3
    assert cl.inter_bandwidth == pytest.approx(1.25e9)
    assert cl.machines[2].memory == 40 * 2 ** 30 and cl.machines[0].memory == 24e9
    assert [d.machine for d in cl.devices] == [0] * 4 + [1] * 4 + [2] * 8


@pytest.mark.parametrize("patch, needle", [
    ({"gpu": "RTX9090"}, "'RTX9090'"),
    ({"intra_bandwidth": "25GB"}, "'25GB'"),
    ({"count": 0}, "count=0"),
    ({"count": "8"}, "'8'"),
    ({"memory": "lots"}, "'lots'"),
    ({"repeat": -1}, "repeat=-1"),
    ({"colour": "red"}, "'colour'"),
])
def test_cluster_errors_name_the_value(patch, needle):
    machine = dict({"gpu": "RTX3090", "count": 8, "intra_bandwidth": "25GB/s"}, **patch)
    with pytest.raises(ConfigError) as e:
        parse_cluster({"inter_machine_bandwidth": "1GB/s", "machines": [machine]})
    assert needle in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- cost model
def _device_params(tree, names, tp):
    """Per-device parameter count of a tree under the runtime's TP shardings (from the model's logical names)."""
    specs = jax.tree_util.tree_leaves(param_specs(tree, names, tp), is_leaf=lambda x: hasattr(x, "index"))
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(l.size / (tp if any(a is not None for a in s) else 1) for l, s in zip(leaves, specs))


@pytest.mark.parametrize("model", ["llama2", "gpt", "moe", "bert"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parameter_counts_match_the_model_trees_under_tp(model, tp):
    """Every model of the zoo (MoE: experts split over TP, the layer figure the mean of a dense and an expert
    layer), against the whole tree of a 4-layer model under the runtime's shardings."""
    cfg = get_config(model, "tiny", num_layers=4)
    lm = zoo_model(model, cfg, abstract=True)
    like, names = lm.params, lm.logical_names
    m = CostModel(cfg, parse_cluster(LOCAL)).model
    layers = sum(_device_params(like["layers"][i], names["layers"][i], tp) for i in range(4))
    assert 4 * m.layer_params(tp) == layers
    assert m.head_params(tp) == _device_params(like["last"], names["last"], tp)
    assert m.embed_params(tp) == _device_params(like["first"], names["first"], tp)


@pytest.mark.parametrize("model", ["llama2", "gpt"])
def test_layer_gemms_carry_the_dot_flops_and_slow_down_when_thin(model):
    """The per-GEMM split the shape-aware rates price must hold exactly the layer's dot FLOPs; and a
    GEMM made thin by a high TP degree or a short micro-batch must run below the large-GEMM rate."""
    cfg = get_config(model, "7B" if model == "llama2" else "6.7B", dtype="bfloat16", seq_len=256)
    cl = parse_cluster({"inter_machine_bandwidth": "1GB/s", "machines": [
        {"gpu": "A100-SXM-80G", "count": 8, "intra_bandwidth": "300GB/s"}]})
    cm = CostModel(cfg, cl)
    m = cm.model
    for tp, mb in itertools.product((1, 2, 8), (1, 4)):
        assert sum(f for f, _ in m.layer_gemms(tp, mb)) == pytest.approx(mb * m.layer_dot_flops(tp), rel=1e-12)
        assert sum(f for f, _ in m.head_gemms(tp, mb)) < mb * m.head_flops(tp)
        rate = mb * m.layer_flops(tp) / cm.layer_seconds(0, tp, mb)
        assert 0 < rate < cm.rate(0) < cm.peak(0)
    per_flop = lambda tp, mb: cm.layer_seconds(0, tp, mb) / (mb * m.layer_flops(tp))
    assert per_flop(8, 1) > per_flop(1, 1) and per_flop(1, 1) > per_flop(1, 4)


@pytest.mark.parametrize("model", ["llama2", "moe", "bert"])
def test_compiled_stages_agree_with_the_cost_model(model):
    """FLOPs: dots are counted exactly, elementwise ops roughly (measured within 3.5%; a FLOP count is a
    property of the HLO, not of the CPU); update bytes are the tensors the model counts plus the temporaries
    XLA keeps for the runtime's finiteness flags over gradients and new parameters, which the model leaves
    out (measured -4.8% on every stage; < 0.01% before those flags existed); backward bytes depend on XLA's
    buffer reuse (measured -17%..+0.2%), hence the wider bound. MoE (experts split over TP, dispatch and
    combine einsums) and BERT (a replicated MLM head) are checked on a 2-layer TP-2 stage and a TP-1 stage."""
    from cfp.runtime.cost_check import check_compiled_stages
    S = lambda d, n: Stage(tuple(d), n, 0)
    if model == "llama2":
        cfg = get_config("llama2", "small", num_layers=3)
        layout = Layout((Pipeline((S([0, 1], 2), S([2], 1)), 4, 2),
                                Pipeline((S([4, 5, 6, 7], 3),), 4, 1)))
    else:
        cfg = get_config(model, "small", num_layers=4)
        layout = Layout((Pipeline((S([0, 1], 2), S([2], 2)), 4, 2),))
    checks = check_compiled_stages(model, cfg, CostModel(cfg, parse_cluster(LOCAL)), layout)
    assert len(checks) == sum(len(p.stages) for p in layout.pipelines)
    for c in checks:
        err = c.errors()
        assert all(np.isfinite(v) for v in err.values())
        assert abs(err["flops_fwd"]) < 0.05 and abs(err["flops_bwd"]) < 0.05, (c.stage, err)
        assert -0.06 < err["bytes_update"] < 0.01, (c.stage, err)
        assert abs(err["bytes_bwd"]) < 0.2, (c.stage, err)


# ----------------------------------------------------------------------------- random clusters
def check_plan(cluster, cfg, options, result):
    lay = result.layout
    lay.validate_for(cfg.num_layers, cluster.num_devices, (cfg.num_heads, cfg.num_heads))
    devs = sorted(d for p in lay.pipelines for s in p.stages for d in s.devices)
    assert devs == list(range(cluster.num_devices))           # every device, once
    for p in lay.pipelines:
        assert sum(s.layers for s in p.stages) == cfg.num_layers and all(s.layers >= 1 for s in p.stages)
        assert p.batch % p.chunks == 0
        for s in p.stages:
            assert cfg.num_heads % s.tp == 0
            assert {cluster.devices[d].machine for d in s.devices} == {s.machine}
    assert lay.global_batch == options.global_batch_size
    est = result.estimate
    assert est.fits and all(s.memory <= s.capacity for row in est.stages for s in row)
    assert np.isfinite(est.step_time) and est.step_time > 0 and 0 < est.mfu < 1


@pytest.mark.parametrize("seed", range(12))
def test_random_clusters_give_valid_plans(seed):
    rng = random.Random(seed)
    cluster = random_cluster(rng, 40)
    # as many layers as half the cluster's memory holds in AdamW state (16 bytes per parameter)
    room = sum(m.memory * m.count for m in cluster.machines) / 2 / (16 * 202e6)
    layers = max(2, min(rng.choice([8, 16, 32]), int(room)))
    cfg = get_config("llama2", "7B", dtype="bfloat16", num_layers=layers, seq_len=rng.choice([512, 2048]))
    options = PlannerOptions(global_batch_size=rng.choice([16, 32, 64]))
    result = find_layout(cluster, cfg, options)
    check_plan(cluster, cfg, options, result)
    again = find_layout(cluster, cfg, options)
    assert again.layout == result.layout                       # deterministic


def optimality_gap(seed, max_devices=6):
    """The planner's gap to the exhaustive optimum on the random cluster of `seed` (None past the
    search's cap), after checking the plan's properties and that the optimum is a lower bound."""
    case = optimality_case(seed, max_devices)
    check_plan(case.cluster, case.config, case.options, case.planned)
    if case.optimum is None:
        return None
    _, est, count = case.optimum
    assert count > 1 and np.isfinite(est.step_time) and est.step_time > 0
    assert est.step_time <= case.planned.estimate.step_time * (1 + 1e-9)   # the optimum is a lower bound
    return case.gap


# Seeds (8 devices at most) where earlier planners missed the optimum, each for another reason: 223
# (4x RTX4090 + 4x L4: another stage order with other layer counts), 262 (the layer split must keep the
# stage behind the slow link light; 4.1% off before), 296 (the embedding on the GPU with fast memory;
# 3.4%), 232, 202, 279 and 247 (one machine cut into TP groups of mixed sizes, a wide one holding the LM
# head: up to 18% off before the re-cut moves), 221 (2 pipelines sharing a machine: 1.95%, the largest
# gap of the sweep). 274 (14.5% off before: unbalanced pipelines with 1 and 7 micro-batches) is left to
# benchmarks/planner_optimality.py, its exhaustive search takes ~15 s.
@pytest.mark.parametrize("seed", [223, 262, 296, 232, 202, 279, 247, 221])
def test_planner_is_within_two_percent_of_the_exhaustive_optimum(seed):
    gap = optimality_gap(seed, max_devices=8)
    if gap is None:
        pytest.skip("exhaustive search passed its layout cap")
    assert gap <= 0.02, gap


def _machines(*specs):
    return {"inter_machine_bandwidth": "12.5GB/s", "machines": [
        {"gpu": g, "count": n, "intra_bandwidth": bw} for g, n, bw in specs]}


S = lambda devices, machine, layers: Stage(devices, layers, machine)   # as the sweep prints them
# Sweep seeds whose exhaustive search (260k-666k layouts, a minute each) is too slow here, with the
# optimum it found written out (8 devices, 4 layers; devices numbered machine by machine):
# 438: the fast devices in one pipeline of 7 micro-batches, the slow ones in another of 1, the LM head on
#      the RTX 3080 Ti pair; 5.3% off before rebuilt pipelines tried another machine last (`_head_orders`)
#      and before a layout met again cost a descent nothing (a device move, a TP merge and the head moved
#      to another machine of the pipeline the device left);
# 207: both pipelines behind an RTX 3080 Ti, TP pairs everywhere else, the head on the L4 pair; 18% off
#      before those two (then 1.9%, and 0% once the budget other descents left continued the best one).
REACHED = {
    438: (_machines(("A100-SXM-80G", 2, "300GB/s"), ("L4", 1, "25GB/s"), ("RTX3080Ti", 2, "300GB/s"),
                    ("A100-PCIe-40G", 2, "16GB/s"), ("RTX3090", 1, "16GB/s")),
          ((S((5,), 3, 1), S((6,), 3, 1), S((0, 1), 0, 2)), 7),
          ((S((7,), 4, 1), S((2,), 1, 1), S((3, 4), 2, 2)), 1)),
    207: (_machines(("L4", 2, "16GB/s"), ("RTX3090", 2, "300GB/s"), ("RTX3080Ti", 1, "25GB/s"),
                    ("RTX3080Ti", 1, "25GB/s"), ("RTX3090", 2, "25GB/s")),
          ((S((4,), 2, 1), S((2, 3), 1, 2), S((0, 1), 0, 1)), 5),
          ((S((5,), 3, 1), S((6, 7), 4, 3)), 3)),
}


@pytest.mark.parametrize("seed", sorted(REACHED))
def test_planner_reaches_the_written_out_optimum_of_sweep_seeds(seed):
    spec, *pipes = REACHED[seed]
    cluster = parse_cluster(spec)
    assert cluster == random_cluster(random.Random(seed), 8)                # the sweep's cluster
    cfg = get_config("llama2", "7B", dtype="bfloat16", num_layers=4, seq_len=1024, hidden_size=2048,
                     num_heads=16, ffn_size=5504)
    options = PlannerOptions(global_batch_size=8, micro_batch_sizes=(1, 2))
    layout = Layout(tuple(Pipeline(st, n, n) for st, n in pipes))
    best = CostModel(cfg, cluster, options.schedule).estimate(layout)
    assert best.fits and np.isfinite(best.step_time) and best.step_time > 0
    assert sorted(d for st, _ in pipes for s in st for d in s.devices) == list(range(8))
    result = find_layout(cluster, cfg, options)
    check_plan(cluster, cfg, options, result)
    assert result.estimate.step_time <= best.step_time * 1.02, result.estimate.step_time / best.step_time


# ----------------------------------------------------------------------------- building blocks
def test_closed_form_limits_match_brute_force():
    cluster = parse_cluster({"inter_machine_bandwidth": "1.25GB/s", "machines": [
        {"gpu": "RTX3080Ti", "count": 2, "intra_bandwidth": "25GB/s"},
        {"gpu": "RTX3090", "count": 2, "intra_bandwidth": "25GB/s"}]})
    cfg = get_config("llama2", "7B", dtype="bfloat16", num_layers=12, seq_len=2048, hidden_size=2048,
                     num_heads=16, ffn_size=5504)
    for schedule in ScheduleName:
        cm = CostModel(cfg, cluster, schedule)
        stages = [Stage((0, 1), 5, 0), Stage((2,), 4, 1), Stage((3,), 3, 1)]
        for mb, n_pipes in itertools.product((1, 2), (1, 2)):
            fits = lambda c: all(cm.stage_memory(s, i, Pipeline(tuple(stages), c * mb, c), n_pipes)
                                 <= cluster.machines[s.machine].memory for i, s in enumerate(stages))
            brute = max([c for c in range(1, 65) if fits(c)] or [0])
            assert max_chunks(cm, stages, mb, n_pipes, 64) == brute
        for i, s in enumerate(stages):
            pipe = Pipeline(tuple(stages), 8, 4)
            fits = lambda n: cm.stage_memory(Stage(s.devices, n, s.machine), i, pipe, 2) <= \
                cluster.machines[s.machine].memory
            cap = list(cm.layer_capacities(pipe, 2))[i]         # what split_layers bounds each stage by
            assert max(0, min(40, cap)) == max([n for n in range(1, 41) if fits(n)] or [0])
        split = split_layers(cm, [Stage(s.devices, 0, s.machine) for s in stages], 4, 4, 1)
        assert split is not None and sum(s.layers for s in split) == 12
        pipe = Pipeline(split, 4, 4)
        assert all(cm.stage_memory(s, i, pipe, 1) <= cluster.machines[s.machine].memory
                   for i, s in enumerate(split))


def test_allocate_chunks_is_the_min_max_optimum():
    rng = random.Random(0)
    for _ in range(30):
        k = rng.randint(1, 3)
        terms = [(rng.uniform(1, 5), rng.uniform(0.1, 2)) for _ in range(k)]
        caps = [rng.randint(1, 6) for _ in range(k)]
        total = rng.randint(k, 10)
        got = allocate_chunks(terms, caps, total)
        feasible = [c for c in itertools.product(*(range(1, cap + 1) for cap in caps)) if sum(c) == total]
        if not feasible:
            assert got is None
            continue
        worst = lambda c: max(a + (x - 1) * w for (a, w), x in zip(terms, c))
        assert worst(got) == pytest.approx(min(worst(c) for c in feasible))


# ----------------------------------------------------------------------------- layout files and CLI
def test_cli_plan_prints_table_and_summary_last(tmp_path, capsys):
    from cfp.cli.main import main
    out = str(tmp_path / "l.json")
    code = main(["plan", "--cluster", "examples/clusters/local.yaml", "--model", "llama2",
                 "--num-layers", "4", "--out", out])
    text = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert text[-3].startswith("estimated MFU: ") and text[-2].startswith("estimated tokens/s: ")
    assert text[-1].startswith("planning time: ")
    assert any(line.startswith("pipeline") for line in text)
    assert load_layout_file(out).model == "llama2"


def test_cli_plan_bad_cluster_is_one_line_exit_2(tmp_path, capsys):
    from cfp.cli.main import main
    bad = tmp_path / "c.yaml"
    bad.write_text("inter_machine_bandwidth: 1GB/s\nmachines:\n  - gpu: RTX9090\n    count: 8\n"
                   "    intra_bandwidth: 25GB/s\n")
    code = main(["plan", "--cluster", str(bad), "--model", "llama2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "RTX9090" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("model", ["moe", "bert"])
def test_cli_plans_moe_and_bert(model, tmp_path, capsys):
    """The planner covers every model of the zoo: the layout file it writes loads (validated against the
    model's config) and says what `cfp train --layout` runs."""
    from cfp.cli.main import main
    out = tmp_path / "m.json"
    code = main(["plan", "--cluster", "examples/clusters/local.yaml", "--model", model, "--num-layers", "4",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    lf = load_layout_file(str(out))
    assert lf.model == model and lf.overrides["num_layers"] == 4
    assert np.isfinite(lf.estimate["step_time_s"]) and lf.estimate["step_time_s"] > 0


def test_split_by_type_deals_every_type_evenly():
    from cfp.planner.metis import split_by_type
    cl = random_cluster(random.Random(207), 8)      # 5 machines of 3 types
    for k in (1, 2, 3, 8):
        parts = split_by_type(cl, k)
        assert sorted(d for p in parts for d in p) == list(range(cl.num_devices))
        for name in {m.gpu.name for m in cl.machines}:
            counts = [sum(cl.machines[cl.devices[d].machine].gpu.name == name for d in p) for p in parts]
            assert max(counts) - min(counts) <= 1 or len(parts) < k
