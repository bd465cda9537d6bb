"""Dim links of operators whose sharding carries over without communication (split, pad, gather, scatter)."""
import jax
import jax.numpy as jnp

from cfp.analysis import dimflow
from cfp.ir.capture import capture


def _op_links(fn, *args, primitive):
    g = capture(fn, *args).graph
    ops = [op for op in g.operators if op.primitive == primitive]
    assert ops, f"no {primitive} in {[op.primitive for op in g.operators]}"
    op = ops[0]
    named = {t: n for n, t in (("in0", op.inputs[0]), ("in1", op.inputs[1] if len(op.inputs) > 1 else None),
                                ("in2", op.inputs[2] if len(op.inputs) > 2 else None))
             if t is not None}
    named.update({t: f"out{k}" for k, t in enumerate(op.outputs) if t is not None})
    return {(named[a], da, named[b], db) for a, da, b, db in dimflow.links(op, g)}


def test_split_links_every_piece_on_the_uncut_dims():
    links = _op_links(lambda x: jnp.split(x, 2, axis=2), jnp.zeros((4, 6, 8)), primitive="split")
    assert links == {("in0", d, f"out{k}", d) for k in (0, 1) for d in (0, 1)}


def test_pad_links_only_unpadded_dims():
    links = _op_links(lambda x: jnp.pad(x, ((0, 0), (2, 1))), jnp.zeros((4, 6)), primitive="pad")
    assert links == {("in0", 0, "out0", 0)}


def test_take_along_axis_gather_carries_the_batch_dims():
    def f(logits, labels):
        return jnp.take_along_axis(logits, labels[..., None], axis=-1)
    links = _op_links(f, jnp.zeros((4, 6, 10)), jnp.zeros((4, 6), jnp.int32), primitive="gather")
    # operand batching dims 0, 1 and the indices' dims 0, 1 are the output's dims 0, 1
    assert {("in0", 0, "out0", 0), ("in0", 1, "out0", 1), ("in1", 0, "out0", 0), ("in1", 1, "out0", 1)} <= links
    assert not any(a == "in0" and da == 2 for a, da, _, _ in links)      # the gathered dim is not carried


def test_embedding_lookup_gather_carries_the_hidden_dim():
    links = _op_links(lambda table, ids: table[ids], jnp.zeros((50, 16)), jnp.zeros((4, 6), jnp.int32),
                      primitive="gather")
    assert ("in0", 1, "out0", 2) in links                  # the offset (hidden) dim
    assert ("in1", 0, "out0", 0) in links and ("in1", 1, "out0", 1) in links
    assert not any(a == "in0" and da == 0 for a, da, _, _ in links)      # the vocabulary is gathered


def test_embedding_gradient_scatter_links_hidden_but_not_the_scattered_tokens():
    def f(table, ids):
        return jax.grad(lambda t: t[ids].sum())(table)
    g = capture(f, jnp.zeros((50, 16)), jnp.zeros((4, 6), jnp.int32)).graph
    op = next(op for op in g.operators if op.primitive.startswith("scatter"))
    operand, updates, out = op.inputs[0], op.inputs[2], op.outputs[0]
    links = set(dimflow.links(op, g))
    assert {(operand, 0, out, 0), (operand, 1, out, 1), (updates, 2, out, 1)} <= links
    assert not any(a == updates and da in (0, 1) and b == out for a, da, b, _ in links)
