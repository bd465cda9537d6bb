"""The attention implementation chosen per device, dtype and shape (issue 39 item 2), on fake device
descriptors, and the numerics of every path that runs on a CPU against a float64 reference written here
(the fused path through `jax.nn.dot_product_attention`'s XLA implementation)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.errors import ConfigError
from cfp.models.attention_select import AttentionCase, DeviceKind, Impl, attend, case_of, choose

CPU, TPU, ROCM = DeviceKind("cpu"), DeviceKind("tpu"), DeviceKind("gpu")
V100, A100, H100, B200 = (DeviceKind("gpu", cc) for cc in ((7, 0), (8, 0), (9, 0), (10, 0)))
GB300_OLD, GB300 = DeviceKind("gpu", (10, 3)), DeviceKind("gpu", (10, 3), 91100)


def _case(dtype="bfloat16", seq_len=1024, head_dim=128, causal=True, packed=False, value_head_dim=None):
    return AttentionCase(dtype, seq_len, head_dim, causal, packed, value_head_dim)


@pytest.mark.parametrize("device,case,want", [
    (A100, _case(), Impl.CUDNN),
    (A100, _case("float16", head_dim=64), Impl.CUDNN),
    (H100, _case(head_dim=256), Impl.CUDNN),
    (B200, _case(head_dim=192), Impl.CUDNN),
    (GB300, _case(), Impl.CUDNN),
    (A100, _case(head_dim=192), Impl.XLA),              # over 128 before Hopper
    (H100, _case(head_dim=264), Impl.XLA),              # over 256
    (H100, _case(head_dim=100), Impl.XLA),              # not a multiple of 8
    (H100, _case("float32"), Impl.XLA),                 # cuDNN's flash attention: 16-bit floats
    (H100, _case(value_head_dim=64), Impl.XLA),         # query and value head dims differ
    (H100, _case(causal=False), Impl.XLA),              # unpacked causal rows only
    (V100, _case(), Impl.XLA),                          # before Ampere
    (GB300_OLD, _case(), Impl.XLA),                     # 10.3 without cuDNN 9.11 known
    (ROCM, _case(), Impl.XLA), (TPU, _case(), Impl.XLA), (CPU, _case(), Impl.XLA),
    (H100, _case(packed=True), Impl.PACKED_BLOCKS),     # packed rows: the block kernel, on every device
    (CPU, _case("float32", seq_len=256, packed=True), Impl.PACKED_BLOCKS),
    (CPU, _case("float32", seq_len=32, packed=True), Impl.XLA),   # one block: the row is its own block
    (H100, _case(packed=True, causal=False), Impl.XLA),
], ids=lambda x: x.name if isinstance(x, Impl) else None)
def test_choice_per_device_dtype_and_shape(device, case, want):
    assert choose(device, case) is want


def test_device_kind_of_a_jax_device():
    assert DeviceKind.of(jax.devices()[0]) == CPU
    assert DeviceKind.of(types.SimpleNamespace(platform="gpu", compute_capability="9.0")) == H100
    assert DeviceKind.of(types.SimpleNamespace(platform="gpu")) == ROCM      # no compute capability: not CUDA
    with pytest.raises(ConfigError, match="platform"):
        DeviceKind("cuda")
    with pytest.raises(ConfigError, match="compute_capability"):
        DeviceKind("gpu", (9,))


def _reference(q, k, v, causal, segment_ids=None):
    """Softmax attention in float64 (grouped-query: query head h reads kv head h // (H // Hkv))."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, h, d = q.shape
    k, v = (np.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    scores = np.einsum("bshd,bthd->bhst", q, k) / np.sqrt(d)
    ok = np.ones((b, 1, s, s), bool)
    if causal:
        ok &= np.tril(np.ones((s, s), bool))
    if segment_ids is not None:
        ok &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    scores = np.where(ok, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhst,bthd->bshd", p / p.sum(-1, keepdims=True), v)


def _qkv(dtype, s=64, h=4, hkv=2, d=32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return [jax.random.normal(kk, (2, s, n, d), jnp.float32).astype(dtype) for kk, n in zip(ks, (h, hkv, hkv))]


# float32: float32 sums of <= 128 terms against the float64 reference (measured max error 7.1e-7 over 5 seeds,
# 4.5e-7 packed: 1e-5 leaves 14x); bfloat16: the inputs exact in both, outputs (|x| < 3) rounded to 8 bits
# (up to 7.8e-3) plus the probabilities rounded before the value product (measured max error 1.0e-2 over 5
# seeds: 4e-2 leaves 4x; a missing causal mask is off by 2.4)
TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_call_through_xla_matches_the_reference(dtype):
    q, k, v = _qkv(dtype)
    want = _reference(q, k, v, causal=True)
    impl = choose(H100, case_of(q, v, causal=True))
    assert impl is (Impl.CUDNN if dtype == "bfloat16" else Impl.XLA)
    got = np.asarray(attend(Impl.CUDNN, q, k, v, causal=True, fused_implementation="xla"), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOLERANCE[dtype], rtol=0)
    # the check can fail: attention without the causal mask is far outside the tolerance
    assert np.abs(_reference(q, k, v, causal=False) - want).max() > 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("impl", [Impl.PACKED_BLOCKS, Impl.XLA])
def test_cpu_paths_match_the_reference(impl):
    q, k, v = _qkv("float32", s=128)
    seg = np.repeat(np.array([[1, 2, 3, 4], [1, 1, 2, 0]]), 32, axis=1).astype(np.int32)
    segment_ids = seg if impl is Impl.PACKED_BLOCKS else None
    if segment_ids is not None:
        assert choose(CPU, case_of(q, v, True, segment_ids)) is Impl.PACKED_BLOCKS
    got = np.asarray(attend(impl, q, k, v, True, None if segment_ids is None else jnp.asarray(seg)), np.float64)
    want = _reference(q, k, v, True, segment_ids)
    keep = np.ones(seg.shape, bool) if segment_ids is None else seg > 0     # padding rows: any finite value
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[keep], want[keep], atol=TOLERANCE["float32"], rtol=0)


def test_attend_rejects_a_path_for_the_wrong_rows():
    q, k, v = _qkv("float32")
    with pytest.raises(ConfigError, match="unpacked"):
        attend(Impl.CUDNN, q, k, v, True, jnp.ones((2, 64), jnp.int32))
    with pytest.raises(ConfigError, match="segment ids"):
        attend(Impl.PACKED_BLOCKS, q, k, v, True)


# ---- the zoo and the run headers ask the chooser (issue 39 item 2): what the header names is what runs

from cfp.models import attention_select as sel  # noqa: E402
from cfp.models import get_config, init_params, loss_fn, make_batch  # noqa: E402


def _recording(monkeypatch):
    """Record the implementation every zoo attention call runs, and run cuDNN's call through XLA (this host
    has no cuDNN; the call and its arguments are the ones a GPU gets)."""
    ran, fused_calls = [], []
    real_attend, real_dpa = sel.attend, jax.nn.dot_product_attention

    def attend(impl, *a, **k):
        ran.append(impl)
        return real_attend(impl, *a, **k)

    def dpa(*a, implementation=None, is_causal=False, **k):
        fused_calls.append((implementation, is_causal))
        return real_dpa(*a, implementation="xla", is_causal=is_causal, **k)

    monkeypatch.setattr(sel, "attend", attend)
    monkeypatch.setattr(jax.nn, "dot_product_attention", dpa)
    return ran, fused_calls


def _loss(model, cfg, params, seed=0):
    return float(jax.jit(loss_fn(model, cfg))(params, make_batch(model, cfg, 2, seed)))


@pytest.mark.parametrize("model,dtype,kinds,want", [
    ("gpt", "bfloat16", (H100,), Impl.CUDNN),
    ("llama2", "bfloat16", (A100,), Impl.CUDNN),         # grouped-query heads go to cuDNN as they are
    ("gpt", "float32", (H100,), Impl.XLA),
    ("gpt", "bfloat16", (V100,), Impl.XLA),
    ("gpt", "bfloat16", (CPU,), Impl.XLA),
    ("gpt", "bfloat16", (H100, V100), Impl.XLA),         # one program for both: the path both run
    ("bert", "bfloat16", (H100,), Impl.XLA),             # bidirectional
], ids=str)
def test_zoo_runs_what_the_header_names(monkeypatch, model, dtype, kinds, want):
    cfg = get_config(model, "tiny", dtype=dtype)
    params = init_params(model, cfg, 0)
    ran, fused_calls = _recording(monkeypatch)
    with sel.on_devices(kinds):
        header = sel.header_line(cfg, packed=False)
        loss = _loss(model, cfg, params)
    assert header.startswith(f"attention: {want.value} (")
    assert set(ran) == {want} and len(ran) == cfg.num_layers
    assert fused_calls == ([("cudnn", True)] * cfg.num_layers if want is Impl.CUDNN else [])
    # the fused call (through XLA here) gives the loss the dense path gives (measured difference 5.6e-5 on
    # both models, bfloat16 rounding; the attention's own numerics: test_fused_call_through_xla_matches_...)
    if want is Impl.CUDNN:
        monkeypatch.undo()
        with sel.on_devices((CPU,)):
            dense = _loss(model, cfg, params)
        assert abs(loss - dense) < 1e-3


def test_cpu_header_and_packed_header():
    cfg = get_config("gpt", "tiny")                      # float32, this host's CPU devices
    assert sel.header_line(cfg, packed=False) == "attention: xla (dense; cpu devices)"
    assert sel.header_line(cfg, packed=True).startswith("attention: packed-blocks (packed causal rows of 64")
    assert sel.header_line(None, packed=False) == "attention: the model's own (not a zoo model)"


def test_decide_for_mixed_devices_names_them():
    c = sel.decide_for((H100, V100, H100), _case())
    assert c.impl is Impl.XLA and "sm 9.0: cudnn" in c.why and "sm 7.0: xla" in c.why
    assert sel.decide_for((H100, A100), _case()).impl is Impl.CUDNN
    with pytest.raises(ConfigError, match="no devices"):
        sel.decide_for((), _case())


def test_dot_product_attention_keeps_the_cpu_path():
    """`cfp.models.attention.dot_product_attention` runs what the chooser picks for a device without fused
    kernels, whatever devices the scope names (the XLA paths' reference for tests and context parallelism)."""
    from cfp.models.attention import dot_product_attention
    q, k, v = _qkv("bfloat16")
    with sel.on_devices((H100,)):
        got = np.asarray(dot_product_attention(q, k, v, True), np.float64)
    np.testing.assert_allclose(got, _reference(q, k, v, True), atol=TOLERANCE["bfloat16"], rtol=0)
