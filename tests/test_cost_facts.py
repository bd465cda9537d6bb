"""Cost facts derived from a model's own traced and compiled parts (`cfp.layered.derive`) against the zoo's
hand-written `ModelCost`, and planning a model nobody here wrote (`tests/layered_mixer.py`) from its facts.

Figures of one definition on both sides (the dots' GEMMs and FLOPs, parameters, optimizer state, the boundary
and token bytes, the softmax passes, the TP all-reduces, forward and backward FLOPs) must agree within 10%.
Figures one side counts by hand and the other reads from XLA differ for reasons the tests name and bound
(`test_compiled_figures_differ_from_the_hand_counts_as_explained`).
"""
import json
import math
import os
import sys

import jax
import numpy as np
import optax
import pytest

import cfp
from cfp.costs import ModelCost, Part
from cfp.errors import ConfigError
from cfp.layered.derive import FactsOptions, derive_facts
from cfp.layered.facts import CostFacts
from cfp.layout import Pipeline, Stage
from cfp.models import get_config, make_batch
from cfp.models.layered import zoo_model
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel

sys.path.insert(0, os.path.dirname(__file__))
import layered_mixer as mixer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = os.path.join(ROOT, "examples", "clusters", "local.yaml")
ZOO = ("gpt", "llama2", "moe", "bert")
TPS = (1, 2)


@pytest.fixture(scope="module")
def zoo():
    """Per zoo model: (its tiny config's ModelCost, the facts derived from its LayeredModel at TP 1 and 2)."""
    out = {}
    for name in ZOO:
        cfg = get_config(name, "tiny", num_layers=2)
        batch = make_batch(name, cfg, 2, jax.random.PRNGKey(0))
        out[name] = ModelCost(cfg), derive_facts(zoo_model(name, cfg), batch, options=FactsOptions(tp_degrees=TPS))
    return out


def _close(a, b, what, rel=0.10):
    assert np.isfinite(a) and np.isfinite(b), (what, a, b)
    assert abs(a - b) <= rel * abs(b), f"{what}: derived {a} vs ModelCost {b} ({a / b if b else float('inf'):.3f}x)"


def _gemms(gemms, shapes=True):
    """A layer's GEMMs as a sorted multiset of (FLOPs, shape as a multiset): the rates price (m, n, k) alike in
    any order (a dot's backward permutes them)."""
    return sorted((round(f), tuple(sorted(float(d) for d in s)) if shapes else ()) for f, s in gemms)


@pytest.mark.parametrize("name", ZOO)
def test_same_definition_figures_agree_with_model_cost(zoo, name):
    """Dots, parameters, optimizer state (AdamW: two float32 moments), boundary and token bytes, the softmax's
    score passes, forward FLOPs (XLA's count of the compiled forward: its dots and elementwise ops, against
    ModelCost's dots plus a rough elementwise count) and the TP all-reduces, at TP 1 and 2, within 10%. The
    backward: the runtime's program (the forward recomputed, then the gradients) in FLOPs, within 10% (XLA
    drops the recomputation of a layer's last projection, whose result the backward never reads: GPT 0.92x).
    The GEMMs one by one (FLOPs and shape), but for MoE at TP 2 (`test_moe_dispatch_is_not_split_by_a_forward_walk`)
    and Llama-2's attention shapes (below)."""
    mc, f = zoo[name]
    for tp in TPS:
        for fig in ("layer_dot_flops", "head_dot_flops", "layer_params", "embed_params", "head_params",
                    "layer_flops", "head_flops", "layer_score_bytes"):
            _close(getattr(f, fig)(tp), getattr(mc, fig)(tp), f"{fig}(tp={tp})")
        for part in Part:
            _close(f.param_bytes(part, tp), mc.param_bytes(part, tp), f"param_bytes({part.value}, tp={tp})")
            _close(f.optimizer_bytes(part, tp), mc.optimizer_bytes(part, tp), f"optimizer_bytes({part.value})")
        for part, fwd, back in (("layer", f.layer_flops, f.layer_backward_flops),
                                ("head", f.head_flops, f.head_backward_flops)):
            ref = 3 * getattr(mc, f"{part}_flops")(tp)
            _close(fwd(tp) + back(tp), ref, f"{part} recomputed forward + backward FLOPs (tp={tp})")
        for mb in (1, 3):
            _close(sum(g for g, _ in f.layer_gemms(tp, mb)), sum(g for g, _ in mc.layer_gemms(tp, mb)),
                   f"layer GEMM FLOPs (tp={tp}, mb={mb})")
            assert _gemms(f.head_gemms(tp, mb)) == _gemms(mc.head_gemms(tp, mb))
            if not (name == "moe" and tp > 1):
                # Llama-2's grouped-query attention batches a kv head's query heads into one GEMM of
                # m = seq x (heads / kv heads), where ModelCost counts one per query head: same FLOPs
                shapes = name != "llama2"
                assert _gemms(f.layer_gemms(tp, mb), shapes) == _gemms(mc.layer_gemms(tp, mb), shapes), (tp, mb)
    assert f.layer_all_reduces(2) == pytest.approx(mc.layer_all_reduces(), rel=0.01)
    assert f.layer_all_reduces(1) == 0
    _close(f.boundary_bytes(), mc.boundary_bytes(), "boundary bytes", rel=0.01)
    assert f.token_bytes() == mc.token_bytes()
    _close(f.model_flops_per_sequence(), mc.model_flops_per_sequence(), "model FLOPs per sequence", rel=0.01)
    assert (f.num_layers, f.dtype, f.tp_divisor) == (mc.num_layers, mc.dtype, math.gcd(mc.tp_divisor, max(TPS)))


def test_moe_dispatch_is_not_split_by_a_forward_walk(zoo):
    """MoE at TP 2: the splits walk forward from the parameters, and the dispatch einsum (tokens into the
    experts' capacity slots) meets no split parameter, so the derived facts keep it whole where ModelCost
    (and XLA's sharding propagation, which also walks back from the split expert weights) counts it over the
    local experts: one dot of 1/(2 x 2) of the expert layer's dot FLOPs more."""
    mc, f = zoo["moe"]
    cfg = mc.config
    dispatch = 2 * cfg.seq_len * cfg.num_experts * cfg.expert_capacity * cfg.hidden_size   # per sequence
    extra = f.layer_dot_flops(2) - mc.layer_dot_flops(2)
    assert extra == pytest.approx(dispatch / 2 / 2, rel=1e-6)       # half of it, in the MoE half of the layers


@pytest.mark.parametrize("name", ZOO)
def test_compiled_figures_differ_from_the_hand_counts_as_explained(zoo, name):
    """What ModelCost counts by hand and the facts read from XLA:

    * memory-bound bytes of a layer: XLA's bytes accessed by the compiled forward's non-dot fusions, read +
      written, against ModelCost's passes (4 over the scores, ~12 hidden-size, the MLP activation's 2). XLA:CPU
      touches the scores 7 times (select, exp, the sum's read, the normalisation's read + write) and copies q,
      k, v and the attention output into and out of the head-major layout of its batched GEMMs (8 hidden-size
      passes ModelCost does not count): 1.5-1.8x for the dense models; the MoE routing masks, which ModelCost
      counts as 4 float32 passes, XLA fuses into fewer: 0.9-1.2x there;
    * a layer's kept activations: the growth of XLA's backward temporaries per layer against ModelCost's list
      of kept tensors: 1.0-1.4x (XLA keeps the q/k/v copies and the norms' statistics too);
    * the head: its softmax passes are 4 per exponentiated logit here, 3 in ModelCost, capped by the head's
      bytes accessed; its kept bytes (XLA's backward transients: logits, their softmax and gradient) 0.75-1.0x
      ModelCost's three float32 logit tensors (XLA fuses the log-softmax into the gradient);
    * the embedding's backward: XLA adds the token-table gradient's scatter into the donated accumulator, so
      none of ModelCost's dense float32 table gradient is a transient.
    """
    mc, f = zoo[name]
    dense = name != "moe"
    for tp in TPS:
        r = f.layer_elementwise_bytes(tp) / mc.layer_elementwise_bytes(tp)
        assert (1.4 <= r <= 1.9) if dense else (0.9 <= r <= 1.2), (tp, r)
        r = f.layer_activation_bytes(tp) / mc.layer_activation_bytes(tp)
        assert 1.0 <= r <= 1.4, (tp, r)
        r = f.head_activation_bytes(tp) / mc.head_activation_bytes(tp)
        assert 0.75 <= r <= 1.0, (tp, r)
        head_bytes = f.head_elementwise_bytes(tp)
        assert f.head_score_bytes(tp) == pytest.approx(min(4 / 3 * mc.head_score_bytes(tp), head_bytes), rel=0.02)
        assert 0.9 <= head_bytes / mc.head_elementwise_bytes(tp) <= 1.6
        assert f.embed_backward_bytes(tp) == 0 < mc.embed_backward_bytes(tp)


def test_facts_round_trip_json(zoo, tmp_path):
    f = zoo["moe"][1]
    path = tmp_path / "facts.json"
    f.save(str(path))
    again = CostFacts.from_json(json.loads(path.read_text()))
    assert again == f
    for tp in TPS:
        assert again.layer_gemms(tp, 2) == f.layer_gemms(tp, 2)
    with pytest.raises(ConfigError, match="not cfp cost facts"):
        CostFacts.from_json({"format": "x"})


# ----------------------------------------------------------------------------- a model of nobody's design
@pytest.fixture(scope="module")
def mixer_facts():
    """The plain-JAX MLP-Mixer's facts, without names (splits guessed) and with the channel MLP named."""
    return {named: derive_facts(mixer.model(4, named=named), mixer.batch(2), options=FactsOptions(tp_degrees=(1, 2, 3, 4)))
            for named in (False, True)}


def _dense_params(n_in, n_out, tp_in=1, tp_out=1):
    return n_in * n_out / tp_in / tp_out + n_out / tp_out


def test_facts_are_per_row_whatever_the_example_micro_batch(mixer_facts):
    """Derived on 2 and on 4 rows, the per-row figures agree: dots exactly, XLA's within 10% (its fusion and
    buffer choices move with the shapes); a figure left per micro-batch would double."""
    a = mixer_facts[False]
    b = derive_facts(mixer.model(4), mixer.batch(4), options=FactsOptions(tp_degrees=(1, 2)))
    for tp in (1, 2):
        assert a.layer_gemms(tp, 3) == b.layer_gemms(tp, 3) and a.embed_gemms(tp, 3) == b.embed_gemms(tp, 3)
        for fig in ("layer_flops", "layer_backward_flops", "layer_elementwise_bytes", "layer_activation_bytes",
                    "layer_temp_bytes", "head_elementwise_bytes", "head_activation_bytes"):
            assert getattr(b, fig)(tp) == pytest.approx(getattr(a, fig)(tp), rel=0.10), (fig, tp)
        assert b.embed_elementwise_bytes(tp)[0] == pytest.approx(a.embed_elementwise_bytes(tp)[0], rel=0.10)
    assert b.boundary_bytes() == a.boundary_bytes() and b.token_bytes() == a.token_bytes()


def test_mixer_splits_follow_names_or_megatron_guess(mixer_facts):
    """Independent counts from the mixer's shapes. Named: only the channel MLP ("embed", "mlp") splits (its
    fc_out bias stays whole), one all-reduce per layer. Guessed: both MLPs split column- then row-parallel
    (their second bias whole), two all-reduces per layer."""
    P, C, T, F = mixer.PATCHES, mixer.CHANNELS, mixer.TOKEN_HIDDEN, mixer.CHANNEL_HIDDEN
    norms = 4 * C
    for tp in (2, 4):
        named = norms + _dense_params(P, T) + _dense_params(T, P) + _dense_params(C, F, tp_out=tp) + C * F / tp + C
        guessed = (norms + _dense_params(P, T, tp_out=tp) + P * T / tp + P + _dense_params(C, F, tp_out=tp)
                   + C * F / tp + C)
        assert mixer_facts[True].layer_params(tp) == pytest.approx(named)
        assert mixer_facts[False].layer_params(tp) == pytest.approx(guessed)
        assert mixer_facts[True].layer_all_reduces(tp) == pytest.approx(1.0)
        assert mixer_facts[False].layer_all_reduces(tp) == pytest.approx(2.0)
        # the stem's result is the activation between stages: a guess that splits it is withdrawn
        for named in (False, True):
            assert mixer_facts[named].embed_params(tp) == pytest.approx(_dense_params(mixer.PATCH_DIM, C))
        # the head's classes split column-parallel when guessed (its loss reduces them: no result is split)
        assert mixer_facts[False].head_params(tp) == pytest.approx(2 * C + _dense_params(C, mixer.CLASSES, tp_out=tp))
    # a degree that divides none of its dims splits nothing
    assert mixer_facts[False].layer_params(3) == mixer_facts[False].layer_params(1)
    assert mixer_facts[False].layer_all_reduces(3) == 0
    one = mixer_facts[False]
    assert one.layer_params(1) == pytest.approx(norms + 2 * _dense_params(P, T) + 2 * _dense_params(C, F) - T - F + C + P)
    # the per-row dot FLOPs of one layer: patch MLP over C channels, channel MLP over P patches
    dots = 2 * 2 * C * P * T + 2 * 2 * P * C * F
    assert one.layer_dot_flops(1) == pytest.approx(dots)
    # the runtime's backward: each dot's two gradient dots and the recomputed forward, but the layer's last
    # dot (the channel MLP's second), whose result the backward never reads (plus a few % elementwise)
    assert one.layer_flops(1) + one.layer_backward_flops(1) == pytest.approx(3 * dots - 2 * P * F * C, rel=0.05)
    assert one.embed_gemms(1, 2)[0][0] == pytest.approx(2 * 2 * P * mixer.PATCH_DIM * C)


def test_optimizer_state_is_the_optimizers_own(mixer_facts):
    """SGD without momentum keeps no state per parameter, AdamW two moments, Adafactor factored moments (less
    than one parameter's bytes); the cost model's stage memory and update read them."""
    model, batch = mixer.model(4), mixer.batch(2)
    sgd = derive_facts(model, batch, optimizer=optax.sgd(0.1), options=FactsOptions(tp_degrees=(1,)))
    ada = derive_facts(model, batch, optimizer=optax.adafactor(1e-3), options=FactsOptions(tp_degrees=(1,)))
    adam = mixer_facts[False]
    p = adam.param_bytes(Part.LAYER)
    assert sgd.optimizer_bytes(Part.LAYER) == 0 and adam.optimizer_bytes(Part.LAYER) == pytest.approx(2 * p)
    assert 0 < ada.optimizer_bytes(Part.LAYER) < p
    cluster = parse_cluster({"inter_machine_bandwidth": "25GB/s",
                             "machines": [{"gpu": "A100-SXM-80G", "count": 2, "intra_bandwidth": "300GB/s"}]})
    st = Stage((0,), 4, 0)
    pipe = Pipeline((st,), 2, 1)
    mem = {k: CostModel(f, cluster).stage_memory(st, 0, pipe, 1) for k, f in (("sgd", sgd), ("adam", adam))}
    extra = 4 * adam.optimizer_bytes(Part.LAYER) + adam.optimizer_bytes(Part.EMBED) + adam.optimizer_bytes(Part.HEAD)
    assert mem["adam"] - mem["sgd"] == pytest.approx(extra, rel=1e-6)


def test_plan_layout_plans_a_user_model():
    """`cfp.plan_layout` on the mixer for this machine's 8 devices: a checked layout of its 4 layers whose
    estimate fits, priced by the mixer's own facts."""
    model = mixer.model(4)
    result = cfp.plan_layout(model, parse_cluster_file(), global_batch=16, example_batch=mixer.batch(2))
    assert isinstance(result, cfp.PlannerResult)
    assert result.layout.num_layers == 4 and result.layout.global_batch == 16
    assert result.estimate.fits and np.isfinite(result.estimate.step_time) and result.estimate.step_time > 0


def parse_cluster_file():
    import yaml
    with open(LOCAL) as f:
        return parse_cluster(yaml.safe_load(f))


def test_cfp_plan_writes_a_layout_file_for_a_factory(tmp_path, capsys):
    """`cfp plan --model tests/layered_mixer.py:make` writes a layout file `cfp train --layout` loads: the
    factory's 8 layers, its global batch."""
    from cfp.cli import main as cli
    from cfp.planner.layout_file import load_layout_file
    out = tmp_path / "layout.json"
    spec = os.path.join(ROOT, "tests", "layered_mixer.py") + ":make"
    code = cli.main(["plan", "--cluster", LOCAL, "--model", spec, "--global-batch-size", "16", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    lf = load_layout_file(str(out))
    assert lf.model == spec and lf.config == "" and lf.layout.num_layers == 8 and lf.layout.global_batch == 16
    assert "cost facts derived" in printed and "estimated rows/s" in printed


@pytest.mark.parametrize("argv,needle", [
    (["--model", "tests/layered_mixer.py:make", "--num-layers", "4"], "--num-layers 4 is for zoo models"),
    (["--model", "tests/no_such_file.py:make"], "no file"),
    (["--model", "tests/layered_mixer.py:nothing"], "no callable 'nothing'"),
    (["--model", "gpt2"], "--model 'gpt2' is not a zoo model"),
])
def test_cfp_plan_bad_model_is_one_line(capsys, monkeypatch, argv, needle):
    from cfp.cli import main as cli
    monkeypatch.chdir(ROOT)
    code = cli.main(["plan", "--cluster", LOCAL, *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_plan_layout_bad_input_is_one_line():
    cluster = parse_cluster_file()
    with pytest.raises(ConfigError, match="needs a cfp.LayeredModel"):
        cfp.plan_layout("gpt", cluster, global_batch=16, example_batch=mixer.batch(2))
    with pytest.raises(ConfigError, match="example_batch="):
        cfp.plan_layout(mixer.model(2), cluster, global_batch=16)
    with pytest.raises(ConfigError, match="optimizer="):
        derive_facts(mixer.model(2), mixer.batch(2), optimizer="adam")
    with pytest.raises(ConfigError, match="tp_degrees"):
        FactsOptions(tp_degrees=(2, 4))
