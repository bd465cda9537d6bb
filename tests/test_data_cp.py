"""Context-parallel attention (sequence dim sharded over a mesh axis; keys/values gathered or ring-passed)
equals unsharded attention, forward and backward, with grouped-query heads and packed segments."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.mesh import MeshSpec
from cfp.models.attention import ContextParallel, CpMethod, attend, context_parallel, cp_attention
from cfp.models.attention import dot_product_attention

# O(1) values; softmax rows of 32 keys in float32, online (ring) vs one-shot summation: a few ulps of
# the O(1) outputs; 64·eps leaves margin for any SIMD summation order.
TOL = 64 * float(np.finfo(np.float32).eps)


def _inputs():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(k1, (2, 32, 4, 8))
    k = jax.random.normal(k2, (2, 32, 2, 8))
    v = jax.random.normal(k3, (2, 32, 2, 8))
    lens = [10, 15, 7]
    seg = jnp.asarray(np.repeat(np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)])[None], 2, 0))
    pos = jnp.asarray(np.repeat(np.concatenate([np.arange(n) for n in lens])[None], 2, 0))
    return q, k, v, seg, pos


@pytest.mark.parametrize("method,packed", [(CpMethod.GATHER, False), (CpMethod.RING, True)])
def test_cp_attention_equals_unsharded(method, packed):
    q, k, v, seg, pos = _inputs()
    seg, pos = (seg, pos) if packed else (None, None)
    mesh = MeshSpec((4, 2), ("cp", "tp")).make()
    cp = ContextParallel(mesh, "cp", method, head_axis="tp")

    def ref(q, k, v):
        return jnp.sum(jnp.sin(dot_product_attention(q, k, v, True, seg)))

    def sharded(q, k, v):
        return jnp.sum(jnp.sin(cp_attention(q, k, v, cp, True, seg, pos)))

    out = jax.jit(lambda q, k, v: cp_attention(q, k, v, cp, True, seg, pos))(q, k, v)
    want = dot_product_attention(q, k, v, True, seg)
    assert np.isfinite(np.asarray(out)).all()
    assert float(jnp.max(jnp.abs(out - want))) <= TOL
    g = jax.jit(jax.grad(sharded, argnums=(0, 1, 2)))(q, k, v)
    gr = jax.grad(ref, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, gr):
        assert float(jnp.max(jnp.abs(a - b))) <= TOL * max(1.0, float(jnp.max(jnp.abs(b))))
    # sensitivity: attention confined to each device's chunk (no exchange) is far from the reference
    chunk = jnp.broadcast_to(jnp.arange(32) // 8, (2, 32)) + (0 if seg is None else 10 * seg)
    local = dot_product_attention(q, k, v, True, chunk)
    assert float(jnp.max(jnp.abs(local - want))) > 1000 * TOL


def test_attend_uses_the_context_parallel_scope():
    q, k, v, seg, pos = _inputs()
    mesh = MeshSpec((8,), ("cp",)).make()
    with context_parallel(ContextParallel(mesh, "cp", CpMethod.RING)):
        jaxpr = str(jax.make_jaxpr(lambda q, k, v: attend(q, k, v, True, seg, pos))(q, k, v))
    assert "ppermute" in jaxpr
    assert "ppermute" not in str(jax.make_jaxpr(lambda q, k, v: attend(q, k, v, True, seg, pos))(q, k, v))
