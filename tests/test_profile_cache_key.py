"""The profile cache key (`cfp.profiling.cachekey.segment_cache_key`) against every input that changes a profile.

A property over a family of small training steps and settings (hypothesis, the deterministic profile of
conftest.py): change one input -- the segment program (an operator's primitive, a literal operand), an
operator's params (a dot's precision), the operand types (shape, dtype), the mesh shape, the device kind, a
profiler option, XLA's flags, JAX's default matmul precision when the step is captured (the captured dots
carry it; replaying them binds that precision, whatever the default when profiling), the cfp/jax/jaxlib
versions -- and the key must change; change nothing, rebuilding every input from scratch (other parameter
values, the parameter dict filled in another order, the options given in another order and with other
cache/progress settings, which change no figure), and it must not. The strategies' layouts are changed one
at a time directly (a strategy whose layout differs is another profile).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cfp
from cfp.analysis.analysis import analyze_with_program
from cfp.profiling.cachekey import segment_cache_key
from cfp.profiling.options import ProfileOptions

ACTIVATIONS = {"tanh": jnp.tanh, "sin": jnp.sin, "gelu": jax.nn.gelu}


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything the key must depend on, one field per input."""
    activation: str = "tanh"                 # the segment program: an operator's primitive
    literal: float = 2.0                     # the segment program: a literal operand
    precision: str | None = None             # operator params: the first dot's precision
    rows: int = 16                           # operand types: the batch's shape
    dtype: str = "float32"                   # operand types: the activations' dtype
    mesh: str = "2x4"                        # the mesh shape (and with it every strategy's layout)
    device_kind: str = "cpu:cpu"
    options: tuple = ()                      # ProfileOptions fields other than the defaults
    xla_flags: str = ""                      # appended to XLA_FLAGS
    matmul_precision: str | None = None      # jax_default_matmul_precision
    versions: tuple = ()                     # (module, version) overrides of cfp, jax, jaxlib


OPTION_VALUES = {
    "kind_gpu": [("measure", None), ("estimate", "A100-SXM-80G"), ("estimate", "H100-SXM"), ("measure", "RTX4090")],
    "iters": [3, 5, 7], "warmup": [0, 2, 3], "max_combinations": [1, 12, 20], "per_block": [1, 2, 3],
    "pool_limit": [1, 8192, 100], "overlap_compile": [True, False],
}
FIELDS = {
    "activation": list(ACTIVATIONS), "literal": [2.0, 3.0, 0.5], "precision": [None, "highest"],
    "rows": [16, 24], "dtype": ["float32", "bfloat16"], "mesh": ["2x4", "4x2", "8"],
    "device_kind": ["cpu:cpu", "gpu:NVIDIA H100 80GB HBM3"], "xla_flags": ["", "--xla_cpu_enable_fast_math=true"],
    "matmul_precision": [None, "highest", "bfloat16"],
    "versions": [(), (("cfp", "0.0.1"),), (("jax", "0.0.1"),), (("jaxlib", "0.0.1"),)],
}


def _options(pairs, shuffled: bool) -> ProfileOptions:
    kw = {}
    for name, value in pairs:
        if name == "kind_gpu":
            kw["kind"], kw["gpu"] = value
        else:
            kw[name] = value
    items = sorted(kw.items(), reverse=shuffled)
    # cache_dir and progress say where figures are kept and whether a bar is drawn: never part of the key
    extra = {"cache_dir": "/elsewhere", "progress": False} if shuffled else {}
    return ProfileOptions(**dict(items), **extra)


def _step(activation: str, literal: float, precision: str | None, dtype: str):
    act = ACTIVATIONS[activation]

    def step(p, x, y):
        def loss(p):
            h = act(jnp.dot(x.astype(dtype), p["w1"].astype(dtype), precision=precision) + p["b1"]) * literal
            return jnp.mean((h.astype(jnp.float32) @ p["w2"] - y) ** 2)
        return jax.value_and_grad(loss)(p)
    return step


@contextlib.contextmanager
def _environment(i: Inputs):
    """XLA_FLAGS, the default matmul precision and the version strings of `i`, restored afterwards."""
    saved_flags = os.environ.get("XLA_FLAGS")
    modules = {"cfp": cfp.version, "jax": jax, "jaxlib": jaxlib}   # cfp's version lives in cfp/version.py
    saved_versions = {name: m.__version__ for name, m in modules.items()}
    try:
        os.environ["XLA_FLAGS"] = ((saved_flags or "") + " " + i.xla_flags).strip()
        for name, version in i.versions:
            modules[name].__version__ = version
        with jax.default_matmul_precision(i.matmul_precision):
            yield
    finally:
        if saved_flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved_flags
        for name, version in saved_versions.items():
            modules[name].__version__ = version


def build(i: Inputs, fresh: bool = False):
    """(program, analysis) of `i`'s step, captured and analysed from scratch; `fresh`: other parameter values
    and the parameter dict filled in the other order (neither changes a profile)."""
    keys = jax.random.split(jax.random.PRNGKey(7 if fresh else 0), 4)
    params = {"w1": jax.random.normal(keys[0], (32, 64)), "b1": jnp.zeros((64,)) + (1.0 if fresh else 0.0),
              "w2": jax.random.normal(keys[1], (64, 32))}
    if fresh:
        params = dict(reversed(list(params.items())))
    x, y = jax.random.normal(keys[2], (i.rows, 32)), jax.random.normal(keys[3], (i.rows, 32))
    with _environment(i):
        analysis, program = analyze_with_program(_step(i.activation, i.literal, i.precision, i.dtype), i.mesh,
                                                 params, x, y)
    return program, analysis


def keys_of(i: Inputs, fresh: bool = False, built=None) -> tuple[str, ...]:
    """The cache key of every segment of `i`'s step, everything built from scratch (unless `built`)."""
    program, analysis = built or build(i, fresh)
    options = _options(i.options, shuffled=fresh)
    with _environment(i):
        return tuple(segment_cache_key(program, analysis, seg, options, i.device_kind)
                     for seg in analysis.segments)


def _inputs():
    fields = {name: st.sampled_from(values) for name, values in FIELDS.items()}
    options = st.lists(st.sampled_from([(k, v) for k, vs in OPTION_VALUES.items() for v in vs]),
                       max_size=3, unique_by=lambda kv: kv[0]).map(lambda kv: tuple(sorted(kv, key=str)))
    return st.builds(Inputs, options=options, **fields)


def _one_change(draw_inputs=_inputs()):
    """(inputs, the same with exactly one input changed to another value)."""
    @st.composite
    def pair(draw):
        i = draw(draw_inputs)
        # under a default matmul precision of "highest" a dot asking for "highest" is the same dot
        same_dots = i.matmul_precision == "highest"
        name = draw(st.sampled_from([f for f in (*FIELDS, *OPTION_VALUES) if not (same_dots and f == "precision")]))
        if name in FIELDS:
            value = draw(st.sampled_from([v for v in FIELDS[name] if v != getattr(i, name)]))
            return i, dataclasses.replace(i, **{name: value})
        current = dict(i.options).get(name)
        value = draw(st.sampled_from([v for v in OPTION_VALUES[name] if v != current]))
        options = tuple(sorted({**dict(i.options), name: value}.items(), key=str))
        if _options(options, False) == _options(i.options, False):       # e.g. the default given explicitly
            value = next(v for v in OPTION_VALUES[name] if _options(tuple(sorted(
                {**dict(i.options), name: v}.items(), key=str)), False) != _options(i.options, False))
            options = tuple(sorted({**dict(i.options), name: value}.items(), key=str))
        return i, dataclasses.replace(i, options=options)
    return pair()


@settings(max_examples=30)
@given(_one_change())
def test_changing_any_one_input_changes_the_key(pair):
    a, b = pair
    assert keys_of(a) != keys_of(b), (a, b)


ONE_CHANGE_FROM_DEFAULTS = ([(name, v) for name, vs in FIELDS.items() for v in vs if v != getattr(Inputs(), name)]
                            + [("options", ((name, v),)) for name, vs in OPTION_VALUES.items() for v in vs
                               if _options(((name, v),), False) != ProfileOptions()])


@pytest.mark.parametrize("name, value", ONE_CHANGE_FROM_DEFAULTS)
def test_each_input_changed_alone_from_the_defaults_changes_the_key(name, value):
    """Every value of every input above, changed alone from the defaults (the property above draws them at
    random; this walks all of them, e.g. the 2x4 mesh against the 4x2 one, whose strategies read alike)."""
    base = Inputs()
    assert keys_of(base) != keys_of(dataclasses.replace(base, **{name: value}))


@settings(max_examples=15)
@given(_inputs())
def test_the_same_inputs_rebuilt_from_scratch_give_the_same_key(i):
    first = keys_of(i)
    assert first == keys_of(i, fresh=True), i
    assert all(k.startswith("seg-") and len(k) == 36 for k in first)


def test_a_strategy_whose_layout_differs_is_another_key():
    """Each strategy's layout of each block, changed alone (one tensor's spec sharded over another mesh axis, or
    made replicated), changes the key; the unchanged analysis still gives the first key."""
    i = Inputs()
    program, analysis = build(i)
    want = keys_of(i, built=(program, analysis))
    seen = 0
    for seg in analysis.segments:
        for b in seg.blocks:
            for s in range(len(analysis.blocks[b].strategies)):
                lay = analysis.layout(b, s)
                t, spec = lay.specs[0]
                other = tuple(() for _ in spec) if any(spec) else ((1,),) + tuple(() for _ in spec[1:])
                store = analysis.__dict__["_layouts"]
                store[(b, s)] = dataclasses.replace(lay, specs=((t, other),) + lay.specs[1:])
                try:
                    assert keys_of(i, built=(program, analysis)) != want, (b, s)
                finally:
                    store[(b, s)] = lay
                seen += 1
    assert seen >= 4 and keys_of(i, built=(program, analysis)) == want


@pytest.mark.parametrize("spelled", ["h100 sxm", "H100 SXM"])
def test_a_gpu_spelled_otherwise_is_the_same_profile(spelled):
    """The catalog accepts a GPU name in several spellings; the profile is the same, and so is the key."""
    i = Inputs()
    built = build(i)
    key = lambda gpu: keys_of(dataclasses.replace(i, options=(("kind_gpu", ("estimate", gpu)),)), built=built)
    assert key(spelled) == key("H100-SXM")

