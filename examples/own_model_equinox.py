"""Your own model on mixed GPUs, Equinox style: a transformer whose layers `eqx.filter_vmap` stacked (the model scans
over them), planned for a cluster file and trained by cfp on a heterogeneous layout of pipelines, checked against
the model's own unsharded training step. Equinox parameters carry no logical dim names: cfp searches the plan of
every tensor-parallel stage with the CFP passes.

    python examples/own_model_equinox.py [--steps 3]
    cfp plan --cluster examples/clusters/local.yaml --model examples/own_model_equinox.py:factory --out eqx.json
    cfp train --model examples/own_model_equinox.py:factory --layout eqx.json --steps 3 --verify

`factory()` returns the model as a `cfp.LayeredModel` (`cfp.from_equinox`), the training data and the optimizer.
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import cfp  # noqa: E402

VOCAB, DIM, SEQ, HEADS, LAYERS, ROWS = 256, 64, 32, 4, 6, 64


class Block(eqx.Module):
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.qkv = eqx.nn.Linear(DIM, 3 * DIM, use_bias=False, key=k[0])
        self.out = eqx.nn.Linear(DIM, DIM, use_bias=False, key=k[1])
        self.up = eqx.nn.Linear(DIM, 4 * DIM, key=k[2])
        self.down = eqx.nn.Linear(4 * DIM, DIM, key=k[3])
        self.ln1, self.ln2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)

    def __call__(self, x):                                   # x: [batch, seq, dim]
        lin = lambda layer, h: jnp.einsum("bsi,oi->bso", h, layer.weight) + (
            layer.bias if layer.bias is not None else 0.0)
        b, s, _ = x.shape
        h = jax.vmap(jax.vmap(self.ln1))(x)
        q, k, v = jnp.split(lin(self.qkv, h).reshape(b, s, 3 * HEADS, DIM // HEADS), 3, axis=2)
        x = x + lin(self.out, jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, DIM))
        return x + lin(self.down, jax.nn.gelu(lin(self.up, jax.vmap(jax.vmap(self.ln2))(x))))


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    layers: Block                 # stacked: every array has a leading dim of LAYERS
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k[0])
        self.layers = eqx.filter_vmap(Block)(jax.random.split(k[1], LAYERS))
        self.head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k[2])

    def __call__(self, tokens):
        x = self.embed.weight[tokens]
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(x, p):
            return eqx.combine(p, static)(x), None
        x, _ = jax.lax.scan(body, x, params)
        return jnp.einsum("bsi,oi->bso", x, self.head.weight)


class Embed(eqx.Module):
    """The embedding as `from_equinox` calls it (tokens -> vectors); LM.embed is an `eqx.nn.Embedding`."""
    weight: jax.Array

    def __call__(self, tokens):
        return self.weight[tokens]


class Head(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return jnp.einsum("bsi,oi->bso", x, self.weight)


class Parts(eqx.Module):
    """The LM's three parts, each callable on a whole batch."""
    embed: Embed
    layers: Block
    head: Head


def loss(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return jnp.sum(ce), jnp.float32(ce.size)


def data(seed: int = 0) -> dict:
    toks = np.random.default_rng(seed).integers(0, VOCAB, (ROWS, SEQ + 1), dtype=np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def optimizer() -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=50)
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.1))


def parts(lm: LM) -> Parts:
    return Parts(Embed(lm.embed.weight), lm.layers, Head(lm.head.weight))


def factory():
    """(LayeredModel, batch, optimizer): what `--model examples/own_model_equinox.py:factory` calls."""
    return cfp.from_equinox(parts(LM(jax.random.PRNGKey(0))), loss, name="equinox-lm"), data(), optimizer()


def own_step(tx):
    """The user's own training step on one device (the whole LM, no cfp): the reference."""
    def step(params, opt_state, batch, static):
        def mean_loss(p):
            s, w = loss(eqx.combine(p, static)(batch["inputs"]), batch)
            return s / w
        value, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return eqx.filter_jit(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    model, batch, tx = factory()
    layout = cfp.Layout.from_lists([[2, 1], [1, 1, 1]], [[4, 2], [1, 2, 3]], [8, 8], [4, 2])
    result = cfp.train_pipelines(model, tx, layout, batch, steps=a.steps, verify=True)
    print(f"cfp pipelines: losses {[round(v, 5) for v in result.losses.values()]} (measured), verify error "
          f"{result.verify_error:.2e} against the LayeredModel's own loss on one device")
    params, static = eqx.partition(LM(jax.random.PRNGKey(0)), eqx.is_array)
    step, opt_state, rows = own_step(tx), tx.init(params), layout.global_batch
    for s in range(a.steps):
        b = {k: np.roll(v, -s * rows, axis=0)[:rows] for k, v in batch.items()}
        params, opt_state, value = step(params, opt_state, b, static)
        print(f"own unsharded step {s + 1}: loss {float(value):.5f} (measured)")


if __name__ == "__main__":
    main()
