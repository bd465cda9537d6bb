"""Baseline layouts: each compiles on a tiny 1-layer GPT train step and matches the unsharded step: loss,
gradients (Adam's first moment) and updated parameters."""
import jax
import numpy as np
import pytest

from conftest import assert_adam_step_matches
from cfp.errors import ConfigError
from cfp.mesh import MeshSpec
from cfp.models import get_config, train_step
from cfp.baselines.handwritten import Baseline, baseline_shardings, baseline_specs, baseline_step


@pytest.fixture(scope="module")
def gpt():
    ts = train_step("gpt", get_config("gpt", "tiny", num_layers=1, num_heads=8))
    params, opt = ts.init(0)
    batch = ts.make_batch(8, 0)
    ref = jax.jit(ts.step)(params, opt, batch)
    return ts, (params, opt, batch), ref


@pytest.mark.parametrize("name,mesh", [("data-parallel", "8"), ("fsdp", "8"), ("megatron-tp", "8"),
                                       ("dp-tp", "2x4")])
def test_baseline_matches_unsharded_step(gpt, name, mesh):
    ts, args, ref = gpt
    m = MeshSpec.parse(mesh).make()
    step, shardings = baseline_step(name, ts.step, args, m, "gpt")
    got = step(*jax.device_put(args, shardings))
    assert_adam_step_matches(args[0], got, ref)     # loss, gradients before the optimizer, then the update
    params = got[0]
    assert params["params"]["layers_0"]["attn"]["query"]["kernel"].sharding.is_equivalent_to(
        shardings[0]["params"]["layers_0"]["attn"]["query"]["kernel"], 3)


def test_layout_rules(gpt):
    _, args, _ = gpt
    m = MeshSpec.parse("2x4").make()
    dp = baseline_specs("data-parallel", args, m)
    assert dp[0]["params"]["layers_0"]["mlp"]["fc_in"]["kernel"] == jax.sharding.PartitionSpec()
    assert dp[2]["inputs"] == jax.sharding.PartitionSpec(("x0", "x1"))
    fs = baseline_specs("fsdp", args, m)
    assert fs[0]["params"]["layers_0"]["mlp"]["fc_in"]["kernel"] == jax.sharding.PartitionSpec(None, ("x0", "x1"))
    assert fs[1][0].mu["params"]["layers_0"]["mlp"]["fc_in"]["kernel"] == \
        fs[0]["params"]["layers_0"]["mlp"]["fc_in"]["kernel"]
    tp = baseline_specs("dp-tp", args, m)
    layer = tp[0]["params"]["layers_0"]
    assert layer["attn"]["query"]["kernel"] == jax.sharding.PartitionSpec(None, "x1")
    assert layer["attn"]["out"]["kernel"] == jax.sharding.PartitionSpec("x1")
    assert layer["mlp"]["fc_in"]["kernel"] == jax.sharding.PartitionSpec(None, "x1")
    assert layer["mlp"]["fc_out"]["kernel"] == jax.sharding.PartitionSpec("x1")
    assert tp[2]["inputs"] == jax.sharding.PartitionSpec("x0")


def test_bad_layouts_raise_config_error():
    ts = train_step("gpt", get_config("gpt", "tiny", num_layers=1))   # 4 heads
    params, opt = ts.init(0)
    args = (params, opt, ts.make_batch(8, 0))
    with pytest.raises(ConfigError, match="heads=4 .* not divisible by the tensor-parallel size 8"):
        baseline_shardings("megatron-tp", args, MeshSpec.parse("8").make(), "gpt")
    with pytest.raises(ConfigError, match="2-D mesh"):
        baseline_shardings("dp-tp", args, MeshSpec.parse("8").make())
    with pytest.raises(ConfigError, match="batch size 6"):
        baseline_shardings("data-parallel", (params, opt, ts.make_batch(6, 0)), MeshSpec.parse("8").make())
    with pytest.raises(ConfigError, match="valid choices"):
        baseline_shardings("zero-2", args, MeshSpec.parse("8").make())
    assert {b.value for b in Baseline} == {"data-parallel", "fsdp", "megatron-tp", "dp-tp"}


def test_same_sharding_tells_layouts_apart_whatever_the_spelling(gpt):
    """`same_sharding` of compiled steps: a layout is the same as itself and as the same placement spelt
    another way (P('x', None) vs P('x')), and differs from every other baseline."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from cfp.sharding.same import same_sharding
    ts, args, _ = gpt
    m = MeshSpec.parse("2x4").make()

    def compiled(shardings):
        out = (shardings[0], shardings[1], NamedSharding(m, P()))
        fn = jax.jit(ts.step, in_shardings=shardings, out_shardings=out)
        return fn.lower(*jax.device_put(args, shardings)).compile()
    names = ("data-parallel", "fsdp", "megatron-tp", "dp-tp")
    shard = {n: baseline_shardings(n, args, m, "gpt") for n in names}
    comp = {n: compiled(s) for n, s in shard.items()}
    for a in names:
        for b in names:
            assert same_sharding(comp[a], comp[b]) == (a == b), (a, b)
    # FSDP again, every spec padded with trailing None: the same placement
    padded = jax.tree_util.tree_map(
        lambda s, x: NamedSharding(m, P(*s.spec, *([None] * (np.ndim(x) - len(s.spec))))), shard["fsdp"], args,
        is_leaf=lambda s: isinstance(s, NamedSharding))
    assert padded != shard["fsdp"] and same_sharding(compiled(padded), comp["fsdp"])
