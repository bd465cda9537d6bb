"""Capture: the flat operator graph replays the step exactly; nested calls are inlined; scans are reported."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.errors import CaptureError
from cfp.ir.capture import capture
from cfp.ir.graph import OpGraph


def _mlp_loss(w1, w2, x):
    h = jax.nn.gelu(x @ w1)                              # `@` is a nested jit; gelu's tanh is custom_jvp-free
    h = jax.checkpoint(lambda a: jax.nn.relu(a) @ w2)(h)  # remat
    return jnp.mean(jax.nn.log_softmax(h) ** 2)           # log_softmax is a nested jit with custom_jvp inside


def _grad_step(w1, w2, x):
    return jax.value_and_grad(_mlp_loss, argnums=(0, 1))(w1, w2, x)


@pytest.fixture(scope="module")
def args():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k[0], (16, 32)), jax.random.normal(k[1], (32, 8)), jax.random.normal(k[2], (8, 16)))


def test_replay_matches_original(args):
    prog = capture(_grad_step, *args)
    got = prog.as_function()(*args)
    want = _grad_step(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_nested_calls_are_inlined(args):
    g = capture(_grad_step, *args).graph
    prims = {op.primitive for op in g.operators}
    assert not prims & {"pjit", "jit", "custom_jvp_call", "custom_vjp_call", "remat", "remat2", "checkpoint"}
    # 2 forward dots; backward: dW1 (x is not differentiated), dW2 and dh (the recomputed dot is dead)
    assert len(g.dots) == 5
    assert all(op.source.startswith(__file__) for op in g.dots), [op.source for op in g.dots]
    assert sum(op.backward for op in g.dots) == 3


def test_graph_is_serialisable_and_consistent(args):
    g = capture(_grad_step, *args).graph
    again = OpGraph.from_dict(__import__("json").loads(g.to_json()))
    assert again == g
    produced = [t for op in g.operators for t in op.outputs if t is not None]
    assert len(produced) == len(set(produced))
    known = {t.id for t in g.tensors}
    assert all(t in known for op in g.operators for t in op.inputs if t is not None)
    assert g.input_paths == ("[0]", "[1]", "[2]")


def test_scan_is_reported_not_dropped():
    def f(x):
        y, _ = jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0, None), x, None, length=3)
        return (y @ x.T).sum()

    x = jnp.ones((4, 4))
    prog = capture(f, x)
    opaque = prog.graph.opaque_operators
    assert [op.primitive for op in opaque] == ["scan"]
    np.testing.assert_allclose(prog.as_function()(x), f(x), rtol=1e-6)


def test_untraceable_function_is_a_capture_error():
    def bad(x):
        if x.sum() > 0:  # data-dependent Python control flow cannot be traced
            return x
        return -x

    with pytest.raises(CaptureError, match="could not trace"):
        capture(bad, jnp.ones(3))
