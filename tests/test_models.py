"""Model zoo: configs, numerics, piecewise (pipeline) execution and model-specific checks."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.errors import ConfigError
from cfp.models import (CONFIGS, MODEL_NAMES, GPTConfig, LlamaConfig, build_model,
                        get_config, init_params, loss_fn, make_batch, stage_modules,
                        train_step)
from cfp.models.llama import apply_rope
from cfp.models.moe import MoEFFN
from cfp.models.moe import top2_gating as _top2_gating

top2_gating = jax.jit(_top2_gating, static_argnums=1)  # one compile beats eager op-by-op

MODELS = list(MODEL_NAMES)
CAUSAL = {"gpt": True, "llama2": True, "moe": True, "bert": False}


@pytest.fixture(scope="module")
def tiny():
    """Per-model cache of (TrainStep, params, opt_state, batch) so init happens once."""
    cache = {}

    def get(name):
        if name not in cache:
            ts = train_step(name)
            params, opt = ts.init(jax.random.PRNGKey(0))
            cache[name] = (ts, params, opt, ts.make_batch(2, jax.random.PRNGKey(1)))
        return cache[name]

    return get


def _ce(logits, targets):
    logp = jax.nn.log_softmax(logits)
    return -np.take_along_axis(np.asarray(logp), np.asarray(targets)[..., None], -1)[..., 0]


def _piecewise(name, cfg, params, tokens):
    embed, layers, head = stage_modules(name, cfg)
    p = params["params"]
    x = embed.apply({"params": p["embed"]}, tokens)
    aux = 0.0
    for i, layer in enumerate(layers):
        x, a = layer.apply({"params": p[f"layers_{i}"]}, x)
        assert a.shape == () and a.dtype == jnp.float32
        aux += a
    return head.apply({"params": p["head"]}, x), aux


# --------------------------------------------------------------------------- all models
@pytest.mark.parametrize("name", MODELS)
def test_init_loss_near_log_vocab_then_training_lowers_it(name, tiny):
    ts, params, opt, batch = tiny(name)
    assert set(params["params"]) == {"embed", "head"} | {
        f"layers_{i}" for i in range(ts.config.num_layers)}
    for leaf in jax.tree_util.tree_leaves(params):
        assert leaf.dtype == jnp.float32 and leaf.ndim <= 3
    step = jax.jit(ts.step)  # one compile serves both checks: step returns the pre-update loss
    losses = []
    for _ in range(6):
        params, opt, loss = step(params, opt, batch)
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(ts.config.vocab_size)) < 0.2, losses
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.parametrize("name", MODELS)
def test_piecewise_equals_full_model(name, tiny):
    ts, params, _, batch = tiny(name)
    logits, aux = build_model(name, ts.config).apply(params, batch["inputs"])
    b, s = batch["inputs"].shape
    assert logits.shape == (b, s, ts.config.vocab_size) and logits.dtype == jnp.float32
    pw_logits, pw_aux = _piecewise(name, ts.config, params, batch["inputs"])
    np.testing.assert_allclose(pw_logits, logits, atol=1e-6, rtol=0)
    np.testing.assert_allclose(pw_aux, aux, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_future_tokens_affect_only_later_logits_iff_causal(name, tiny):
    ts, params, _, batch = tiny(name)
    model = build_model(name, ts.config)
    tokens = batch["inputs"]
    t = tokens.shape[1] // 2
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % (ts.config.vocab_size - 1))
    a, _ = model.apply(params, tokens)
    b, _ = model.apply(params, changed)
    before = np.abs(np.asarray(a[:, :t] - b[:, :t])).max()
    after = np.abs(np.asarray(a[:, t:] - b[:, t:])).max()
    assert after > 1e-4
    if CAUSAL[name]:
        assert before < 1e-6
    else:
        assert before > 1e-4


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_compute_keeps_float32_params(name, tiny):
    ts, params, _, batch = tiny(name)
    cfg = dataclasses.replace(ts.config, dtype="bfloat16")
    shapes = jax.eval_shape(lambda: init_params(name, cfg, 0))  # trace only: no compile
    assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(params)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(shapes))
    embed, layers, head = stage_modules(name, cfg)
    x = embed.apply({"params": params["params"]["embed"]}, batch["inputs"])
    assert x.dtype == jnp.bfloat16
    for i, layer in enumerate(layers):
        x, aux = layer.apply({"params": params["params"][f"layers_{i}"]}, x)
        assert x.dtype == jnp.bfloat16 and aux.dtype == jnp.float32
    logits = head.apply({"params": params["params"]["head"]}, x)
    assert logits.dtype == jnp.float32
    # bf16 compute tracks the float32 model (MoE may route a few near-tie tokens differently).
    f32_logits = _piecewise(name, ts.config, params, batch["inputs"])[0]
    assert np.mean(np.abs(np.asarray(logits - f32_logits)) < 0.05) > 0.98
    loss = float(_ce(logits, batch["targets"]).mean())
    assert abs(loss - math.log(cfg.vocab_size)) < 0.3


@pytest.mark.parametrize("name", MODELS)
def test_make_batch_deterministic_and_shaped(name):
    cfg = get_config(name)
    a = make_batch(name, cfg, 3, jax.random.PRNGKey(7))
    b = make_batch(name, cfg, 3, jax.random.PRNGKey(7))
    c = make_batch(name, cfg, 3, jax.random.PRNGKey(8))
    for k in ("inputs", "targets", "weights"):
        assert a[k].shape == (3, cfg.seq_len)
        np.testing.assert_array_equal(a[k], b[k])
    assert a["inputs"].dtype == jnp.int32 and a["weights"].dtype == jnp.float32
    assert not np.array_equal(a["targets"], c["targets"])
    if CAUSAL[name]:
        np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
        assert np.all(a["weights"] == 1)


def test_train_step_bundle_and_custom_optimizer():
    import optax
    ts = train_step("gpt", get_config("gpt"), optimizer=optax.sgd(0.1))
    assert (ts.model_name, ts.config) == ("gpt", get_config("gpt"))
    params, opt = jax.eval_shape(lambda: ts.init(0))  # trace only
    assert jax.tree_util.tree_leaves(opt) == []  # plain SGD keeps no state; adamw would
    assert jax.tree_util.tree_leaves(jax.eval_shape(lambda: train_step("gpt").init(0))[1])
    assert ts.make_batch(2, 0)["inputs"].shape == (2, 64)


def test_loss_is_weighted_mean_cross_entropy(tiny):
    ts, params, _, batch = tiny("gpt")
    logits, _ = build_model("gpt", ts.config).apply(params, batch["inputs"])
    ce = _ce(logits, batch["targets"])
    w = np.zeros(ce.shape, np.float32)
    w[:, ::3] = 1.0
    got = float(ts.loss(params, dict(batch, weights=jnp.asarray(w))))
    np.testing.assert_allclose(got, (ce * w).sum() / w.sum(), rtol=1e-5)


def test_bert_batch_masks_positions():
    cfg = get_config("bert", mask_prob=0.15)
    batch = {k: np.asarray(v) for k, v in make_batch("bert", cfg, 16, 3).items()}
    masked = batch["weights"] == 1
    assert set(np.unique(batch["weights"])) <= {0.0, 1.0}
    assert masked.any(axis=1).all()  # at least one prediction per sequence
    assert np.all(batch["inputs"][masked] == cfg.vocab_size - 1)
    np.testing.assert_array_equal(batch["inputs"][~masked], batch["targets"][~masked])
    assert batch["targets"].max() < cfg.vocab_size - 1  # [MASK] is never a target
    assert 0.08 < masked.mean() < 0.25
    one = make_batch("bert", get_config("bert", mask_prob=1e-6), 4, 0)
    np.testing.assert_array_equal(np.asarray(one["weights"]).sum(axis=1), 1)


# --------------------------------------------------------------------------- llama
def test_llama_gqa_matches_mha_with_repeated_kv_heads(tiny):
    _, params, _, batch = tiny("llama2")
    gqa = get_config("llama2", "tiny")  # 4 heads, 2 kv heads
    mha = dataclasses.replace(gqa, num_kv_heads=4)
    assert gqa.num_kv_heads == 2 < gqa.num_heads
    group = gqa.num_heads // gqa.num_kv_heads

    def widen(path, x):  # kv kernels [H, Hkv, D] -> [H, Hq, D]: query head h reads kv h//group
        names = [getattr(k, "key", None) for k in path]
        return jnp.repeat(x, group, axis=1) if "key" in names or "value" in names else x

    mha_params = jax.tree_util.tree_map_with_path(widen, params)
    assert mha_params["params"]["layers_0"]["attn"]["key"]["kernel"].shape == (64, 4, 16)
    tokens = batch["inputs"]
    a, _ = build_model("llama2", gqa).apply(params, tokens)
    b, _ = build_model("llama2", mha).apply(mha_params, tokens)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_rope_dot_product_depends_only_on_offset():
    q, k = jax.random.normal(jax.random.PRNGKey(0), (2, 1, 1, 1, 16))
    rope = jax.jit(lambda x, p: apply_rope(x, positions=p))

    def dot(m, n):
        return float(jnp.sum(rope(q, jnp.array([m])) * rope(k, jnp.array([n]))))

    assert dot(5, 2) == pytest.approx(dot(13, 10), abs=1e-4)
    assert dot(5, 2) == pytest.approx(dot(3, 0), abs=1e-4)
    assert dot(5, 2) != pytest.approx(dot(5, 4), abs=1e-3)
    # Norm-preserving rotation.
    np.testing.assert_allclose(jnp.linalg.norm(rope(q, jnp.array([9]))),
                               jnp.linalg.norm(q), rtol=1e-5)


# --------------------------------------------------------------------------- moe
def test_moe_capacity_respected_and_overflow_dropped():
    g, s, e, cap = 2, 16, 4, 4
    # Every token prefers expert 0, then expert 1: both fill after `cap` tokens.
    logits = jnp.zeros((g, s, e)).at[..., 0].set(5.0).at[..., 1].set(3.0)
    dispatch, combine, aux = top2_gating(logits, cap)
    assert dispatch.shape == combine.shape == (g, s, e, cap)
    d = np.asarray(dispatch)
    assert d.sum(axis=1).max() <= 1  # a slot holds at most one token
    assert np.all(d.sum(axis=(1, 3)) <= cap)  # no expert over capacity
    np.testing.assert_array_equal(d.sum(axis=(1, 3))[:, :2], cap)
    np.testing.assert_array_equal(d[:, :cap, 0].sum(-1), 1)  # earliest tokens seated
    assert d[:, cap:].sum() == 0  # later tokens dropped from both full experts
    np.testing.assert_allclose(np.asarray(combine).sum(axis=(2, 3))[:, :cap], 1.0, rtol=1e-6)
    assert float(aux) == pytest.approx(4.0 * float(jax.nn.softmax(logits[0, 0])[0]), rel=1e-5)


def test_moe_balanced_routing_aux_is_one_and_capacity_rule():
    logits = jnp.tile(jnp.eye(4) * 4.0 + jnp.roll(jnp.eye(4), 1, 0) * 2.0, (1, 2, 1))
    dispatch, _, aux = top2_gating(logits, 4)  # 8 tokens, 16 slots: nothing dropped
    assert float(aux) == pytest.approx(1.0, rel=1e-6)
    assert float(dispatch.sum()) == 16
    cfg = get_config("moe")
    assert cfg.expert_capacity == int(cfg.capacity_factor * 64 / 4) == 32


def test_moe_identical_experts_without_drops_equal_dense_ffn():
    cfg = get_config("moe", capacity_factor=8.0)  # capacity = whole group: nothing dropped
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 64))
    rs = np.random.RandomState(0)
    wi = jnp.asarray(rs.normal(0, 0.1, (64, 256)), jnp.float32)
    wo = jnp.asarray(rs.normal(0, 0.1, (256, 64)), jnp.float32)
    params = {"gate": jnp.asarray(rs.normal(0, 0.5, (64, 4)), jnp.float32),
              "wi": jnp.stack([wi] * 4), "wo": jnp.stack([wo] * 4)}
    assert jax.tree_util.tree_map(jnp.shape, params) == jax.tree_util.tree_map(
        jnp.shape, jax.eval_shape(MoEFFN(cfg).init, jax.random.PRNGKey(1), x)["params"])
    y, aux = MoEFFN(cfg).apply({"params": params}, x)
    np.testing.assert_allclose(y, jax.nn.gelu(x @ wi) @ wo, atol=1e-5)
    assert float(aux) > 0


def test_moe_odd_layers_are_moe_and_aux_enters_loss(tiny):
    ts, params, _, batch = tiny("moe")
    p = params["params"]
    assert "moe" in p["layers_1"] and "mlp" in p["layers_0"] and "moe" not in p["layers_0"]
    assert p["layers_1"]["moe"]["wi"].shape == (4, 64, 256)
    assert p["layers_1"]["moe"]["wo"].shape == (4, 256, 64)
    logits, aux = build_model("moe", ts.config).apply(params, batch["inputs"])
    assert float(aux) > 0
    plain = jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits),
                                          batch["targets"][..., None], -1))
    assert float(ts.loss(params, batch)) == pytest.approx(float(plain) + 0.01 * float(aux),
                                                         rel=1e-5)


def test_moe_tokens_not_divisible_by_group_raise_config_error():
    model = build_model("moe", get_config("moe"))
    with pytest.raises(ConfigError, match=r"1\*48=48.*expert_group_size=64"):
        jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 48), jnp.int32))
    cfg = get_config("moe", "paper")
    assert (cfg.seq_len, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.vocab_size,
            cfg.num_experts, cfg.expert_group_size) == (1024, 1280, 16, 4, 32000, 32, 2048)
    assert CONFIGS["moe"]["paper-2head"].num_heads == 2


# --------------------------------------------------------------------------- configs
def test_named_configs_present_and_valid():
    assert MODEL_NAMES == ("gpt", "llama2", "moe", "bert")
    gpt = CONFIGS["gpt"]
    assert {"tiny", "small", "125M", "350M", "760M", "1.3B", "2.6B", "6.7B", "F"} <= set(gpt)
    assert gpt["1.3B"] == GPTConfig(1024, 2048, 24, 32, 51200)
    assert gpt["F"].hidden_size == 4096 and gpt["F"].num_heads == 32
    assert gpt["tiny"].ffn_size == 4 * 64
    l7 = CONFIGS["llama2"]["7B"]
    assert (l7.hidden_size, l7.num_layers, l7.ffn_size, l7.num_kv_heads) == (4096, 32, 11008, 32)
    assert CONFIGS["llama2"]["13B"].hidden_size == 5120
    assert {"tiny", "small", "paper", "paper-2head"} <= set(CONFIGS["moe"])
    assert {"tiny", "small", "base", "large"} <= set(CONFIGS["bert"])


def test_get_config_overrides():
    cfg = get_config("gpt", "F", num_layers=4)
    assert cfg.num_layers == 4 and cfg.hidden_size == 4096
    assert get_config("gpt", "tiny", hidden_size=128).ffn_size == 512  # default re-derived
    assert get_config("gpt", "tiny", hidden_size=128, ffn_size=100).ffn_size == 100
    assert get_config("llama2", "7B", num_heads=16).num_kv_heads == 16
    assert get_config("llama2", "tiny", num_heads=8).num_kv_heads == 2  # explicit GQA kept
    assert get_config("gpt") == CONFIGS["gpt"]["tiny"]
    assert get_config("gpt", "tiny", dtype=jnp.bfloat16).dtype == "bfloat16"


@pytest.mark.parametrize("args, match", [
    (("gptx",), r"'gptx'.*gpt, llama2, moe, bert"),
    (("gpt", "huge"), r"'huge'.*tiny, small, 125M"),
    (("llama2", "65B"), r"'65B'.*7B, 13B"),
])
def test_get_config_unknown_names_list_valid_choices(args, match):
    with pytest.raises(ConfigError, match=match):
        get_config(*args)


@pytest.mark.parametrize("model, overrides, match", [
    ("gpt", dict(hidden_size=100, num_heads=3), r"hidden_size=100.*num_heads=3"),
    ("gpt", dict(num_layers=0), r"num_layers=0"),
    ("gpt", dict(num_layers=-2), r"num_layers=-2"),
    ("gpt", dict(seq_len=1.5), r"seq_len=1.5"),
    ("gpt", dict(dtype="float16"), r"'float16'.*float32, bfloat16"),
    ("gpt", dict(bogus=1), r"'bogus'.*seq_len"),
    ("llama2", dict(num_kv_heads=3), r"num_kv_heads=3.*num_heads=4"),
    ("llama2", dict(rope_theta=0), r"rope_theta=0"),
    ("moe", dict(num_experts=1), r"num_experts=1"),
    ("moe", dict(capacity_factor=0.0), r"capacity_factor=0.0"),
    ("bert", dict(mask_prob=1.5), r"mask_prob=1.5"),
])
def test_bad_config_values_raise_config_error(model, overrides, match):
    with pytest.raises(ConfigError, match=match):
        get_config(model, "tiny", **overrides)


def test_config_errors_are_value_errors_and_types_checked():
    with pytest.raises(ValueError, match="hidden_size=0"):
        LlamaConfig(64, 0, 2, 4, 512, ffn_size=10)
    with pytest.raises(ConfigError, match="LlamaConfig.*GPTConfig"):
        build_model("llama2", get_config("gpt"))
    with pytest.raises(ConfigError, match="'t5'.*gpt, llama2"):
        train_step("t5")
    with pytest.raises(ConfigError, match="seq_len=64"):
        jax.eval_shape(build_model("gpt").init, jax.random.PRNGKey(0),
                       jnp.zeros((1, 65), jnp.int32))
