"""Model zoo: configs, numerics, piecewise (pipeline) execution and model-specific checks."""
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

MODELS = ["gpt", "llama2"]
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
def test_init_loss_near_log_vocab_and_float32_params(name, tiny):
    ts, params, _, batch = tiny(name)
    assert set(params["params"]) == {"embed", "head"} | {
        f"layers_{i}" for i in range(ts.config.num_layers)}
    for leaf in jax.tree_util.tree_leaves(params):
        assert leaf.dtype == jnp.float32 and leaf.ndim <= 3
    loss = float(ts.loss(params, batch))
    assert math.isfinite(loss)
    assert abs(loss - math.log(ts.config.vocab_size)) < 0.2, loss


@pytest.mark.parametrize("name", MODELS)
def test_training_lowers_loss_on_fixed_batch(name, tiny):
    ts, params, opt, batch = tiny(name)
    step = jax.jit(ts.step)
    losses = []
    for _ in range(6):
        params, opt, loss = step(params, opt, batch)
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses)
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
def test_bfloat16_compute_keeps_float32_params(name):
    cfg = get_config(name, "tiny", dtype="bfloat16", num_layers=1)
    params = init_params(name, cfg, 0)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    embed, layers, head = stage_modules(name, cfg)
    batch = make_batch(name, cfg, 2, 0)
    x = embed.apply({"params": params["params"]["embed"]}, batch["inputs"])
    assert x.dtype == jnp.bfloat16
    x, aux = layers[0].apply({"params": params["params"]["layers_0"]}, x)
    assert x.dtype == jnp.bfloat16 and aux.dtype == jnp.float32
    logits, _ = build_model(name, cfg).apply(params, batch["inputs"])
    assert logits.dtype == jnp.float32
    loss = float(loss_fn(name, cfg)(params, batch))
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


def test_loss_is_weighted_mean_cross_entropy(tiny):
    ts, params, _, batch = tiny("gpt")
    logits, _ = build_model("gpt", ts.config).apply(params, batch["inputs"])
    logp = jax.nn.log_softmax(logits)
    ce = -np.take_along_axis(np.asarray(logp), np.asarray(batch["targets"])[..., None], -1)[..., 0]
    w = np.zeros(ce.shape, np.float32)
    w[:, ::3] = 1.0
    got = float(ts.loss(params, dict(batch, weights=jnp.asarray(w))))
    np.testing.assert_allclose(got, (ce * w).sum() / w.sum(), rtol=1e-5)


# --------------------------------------------------------------------------- llama
def test_llama_gqa_matches_mha_with_repeated_kv_heads():
    gqa = get_config("llama2", "tiny", num_layers=1)  # 4 heads, 2 kv heads
    mha = get_config("llama2", "tiny", num_layers=1, num_kv_heads=4)
    assert gqa.num_kv_heads == 2 < gqa.num_heads
    params = init_params("llama2", gqa, 0)
    group = gqa.num_heads // gqa.num_kv_heads

    def widen(path, x):  # kv kernels [H, Hkv, D] -> [H, Hq, D]: query head h reads kv h//group
        names = [getattr(k, "key", None) for k in path]
        return jnp.repeat(x, group, axis=1) if "key" in names or "value" in names else x

    mha_params = jax.tree_util.tree_map_with_path(widen, params)
    assert mha_params["params"]["layers_0"]["attn"]["key"]["kernel"].shape == (64, 4, 16)
    tokens = make_batch("llama2", gqa, 2, 0)["inputs"]
    a, _ = build_model("llama2", gqa).apply(params, tokens)
    b, _ = build_model("llama2", mha).apply(mha_params, tokens)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_rope_dot_product_depends_only_on_offset():
    q, k = jax.random.normal(jax.random.PRNGKey(0), (2, 1, 1, 1, 16))

    def dot(m, n):
        qm = apply_rope(q, positions=jnp.array([m]))
        kn = apply_rope(k, positions=jnp.array([n]))
        return float(jnp.sum(qm * kn))

    assert dot(5, 2) == pytest.approx(dot(13, 10), abs=1e-4)
    assert dot(5, 2) == pytest.approx(dot(3, 0), abs=1e-4)
    assert dot(5, 2) != pytest.approx(dot(5, 4), abs=1e-3)
    # Norm-preserving rotation.
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, positions=jnp.array([9]))),
                               jnp.linalg.norm(q), rtol=1e-5)


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
    (("llama2", "70B"), r"'70B'.*7B, 13B"),
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
        build_model("gpt").init(jax.random.PRNGKey(0), jnp.zeros((1, 65), jnp.int32))
