"""Capture: the flat operator graph replays the step exactly; nested calls are inlined; scans are reported."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap

from cfp.errors import CaptureError
from cfp.ir import _jax_internals as internals
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
    assert not prims & _CALL_LIKE
    # 2 forward dots; backward: dW1 (x is not differentiated), dW2 and dh (the recomputed dot is dead)
    assert len(g.dots) == 5
    assert all(op.source.startswith(__file__) for op in g.dots), [op.source for op in g.dots]
    assert sum(op.backward for op in g.dots) == 3


@jax.custom_jvp
def _cube(x):
    return x ** 3


_cube.defjvp(lambda p, t: (_cube(p[0]), 3 * p[0] ** 2 * t[0]))


@jax.custom_vjp
def _softsign(x):
    return x / (1 + jnp.abs(x))


_softsign.defvjp(lambda x: (_softsign(x), x), lambda x, g: (g / (1 + jnp.abs(x)) ** 2,))


@custom_vmap
def _sin_vmapped(x):
    return jnp.sin(x)


_sin_vmapped.def_vmap(lambda axis_size, in_batched, x: (jnp.sin(x), in_batched[0]))

# calling the result of `jit(...).trace` binds jax 0.12's `eval_jaxpr` (which replaced closed_call/call)
_TRACED = jax.jit(lambda a, w: jnp.sin(a) @ w).trace(jax.ShapeDtypeStruct((8, 16), jnp.float32),
                                                     jax.ShapeDtypeStruct((16, 16), jnp.float32))
_SAVE_H = jax.checkpoint_policies.save_only_these_names("h")


def _calls(w, x, vmapped=True):
    """One of each call-like primitive JAX emits, with a checkpoint_name under a remat policy."""
    h = _TRACED(x, w)
    h = jax.checkpoint(lambda a: checkpoint_name(jnp.tanh(a), "h") @ w.T, policy=_SAVE_H)(h)
    h = _softsign(_cube(h))
    h = _sin_vmapped(h) if vmapped else h
    return jnp.mean(jax.jit(lambda a: a @ w)(h) ** 2)


_CALL_LIKE = {"jit", "eval_jaxpr", "remat2", "custom_jvp_call", "custom_vjp_call", "custom_vmap_call", "name"}


def _raw_primitives(jaxpr) -> set[str]:
    """Every primitive of `jaxpr` and of the jaxprs in its equations' params."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for v in eqn.params.values():
            if hasattr(v, "eqns"):
                out |= _raw_primitives(v)
    return out


def test_every_call_like_primitive_jax_emits_is_inlined(args):
    """The names cfp inlines are the ones the installed JAX emits (none stale), and none is left after capture."""
    w, x = args[0][:, :16], args[2]
    raw = _raw_primitives(jax.make_jaxpr(_calls)(w, x))
    assert _CALL_LIKE <= raw                                                      # jax 0.12's names
    assert set(internals.CALL_PRIMITIVES) | internals.IDENTITY_PRIMITIVES <= raw   # none stale in cfp's table
    prog = capture(_calls, w, x)
    assert not {op.primitive for op in prog.graph.operators} & _CALL_LIKE
    assert len(prog.graph.dots) == 3 and not prog.graph.opaque_operators
    np.testing.assert_allclose(prog.as_function()(w, x), _calls(w, x), rtol=1e-6)


def test_gradient_through_every_call_like_primitive_replays(args):
    w, x = args[0][:, :16], args[2]
    step = jax.value_and_grad(lambda w, x: _calls(w, x, vmapped=False))     # custom_vmap has no VJP
    assert {"jit", "eval_jaxpr", "remat2", "custom_jvp_call"} <= _raw_primitives(jax.make_jaxpr(step)(w, x))
    prog = capture(step, w, x)
    assert not {op.primitive for op in prog.graph.operators} & _CALL_LIKE
    for a, b in zip(jax.tree_util.tree_leaves(prog.as_function()(w, x)), jax.tree_util.tree_leaves(step(w, x))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_graph_is_serialisable_and_consistent(args):
    g = capture(_grad_step, *args).graph
    again = OpGraph.from_dict(__import__("json").loads(g.to_json()))
    assert again == g
    produced = [t for op in g.operators for t in op.outputs if t is not None]
    assert len(produced) == len(set(produced))
    known = {t.id for t in g.tensors}
    assert all(t in known for op in g.operators for t in op.inputs if t is not None)
    assert g.input_paths == ("[0]", "[1]", "[2]")


def test_scan_is_seen_through_and_while_is_reported_not_dropped():
    def f(x):
        y, _ = jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0, None), x, None, length=3)
        z = jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c * 2.0, y)
        return (z @ x.T).sum()

    x = jnp.ones((4, 4))
    prog = capture(f, x)
    assert [op.primitive for op in prog.graph.opaque_operators] == ["while"]
    (loop,) = prog.graph.loops
    assert loop.length == 3
    body = [prog.graph.operators[i].primitive for i in loop.body]
    assert "sin" in body and all(prog.graph.operators[i].loop == 0 for i in loop.body)
    np.testing.assert_allclose(prog.as_function()(x), f(x), rtol=1e-6)


def test_untraceable_function_is_a_capture_error():
    def bad(x):
        if x.sum() > 0:  # data-dependent Python control flow cannot be traced
            return x
        return -x

    with pytest.raises(CaptureError, match="could not trace"):
        capture(bad, jnp.ones(3))
