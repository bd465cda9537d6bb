"""Your own model on mixed GPUs, Flax NNX style: a transformer whose layers are a list of NNX modules, their
parameters named with `nnx.with_partitioning`, planned for a cluster file and trained by cfp on a heterogeneous
layout of pipelines, checked against the model's own unsharded training step.

    python examples/own_model_nnx.py [--steps 3]
    cfp plan --cluster examples/clusters/local.yaml --model examples/own_model_nnx.py:factory --out nnx.json
    cfp train --model examples/own_model_nnx.py:factory --layout nnx.json --steps 3 --verify

`factory()` returns the model as a `cfp.LayeredModel` (`cfp.from_nnx` splits the NNX model's state into
embedding, layers and head), the training data and the optax optimizer.
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import cfp  # noqa: E402

VOCAB, DIM, SEQ, HEADS, LAYERS, ROWS = 256, 64, 32, 4, 6, 64
nnx.use_eager_sharding(False)   # logical names are metadata here; cfp maps them to each stage's devices
named = nnx.with_partitioning
init = nnx.initializers.lecun_normal()


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.RMSNorm(DIM, rngs=rngs), nnx.RMSNorm(DIM, rngs=rngs)
        self.qkv = nnx.Linear(DIM, 3 * DIM, use_bias=False, kernel_init=named(init, ("embed", "heads")), rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, use_bias=False, kernel_init=named(init, ("heads", "embed")), rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, use_bias=False, kernel_init=named(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, use_bias=False, kernel_init=named(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        b, s, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)).reshape(b, s, 3 * HEADS, DIM // HEADS), 3, axis=2)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, DIM)
        x = x + self.out(a)
        return x + self.down(jax.nn.silu(self.up(self.ln2(x))))


class Head(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.proj = nnx.Linear(DIM, VOCAB, use_bias=False, kernel_init=named(init, ("embed", "vocab")), rngs=rngs)

    def __call__(self, x):
        return self.proj(self.norm(x))


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, embedding_init=named(nnx.initializers.normal(0.02), ("vocab", "embed")),
                               rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.head = Head(rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss(logits, batch):
    """Token cross-entropy summed over the batch, and its token count."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return jnp.sum(ce), jnp.float32(ce.size)


def data(seed: int = 0) -> dict:
    toks = np.random.default_rng(seed).integers(0, VOCAB, (ROWS, SEQ + 1), dtype=np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def optimizer() -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=50)
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.1))


def factory():
    """(LayeredModel, batch, optimizer): what `--model examples/own_model_nnx.py:factory` calls."""
    return cfp.from_nnx(LM(nnx.Rngs(0)), loss, inputs="inputs", name="nnx-lm"), data(), optimizer()


def own_step(tx):
    """The user's own training step on one device (the whole NNX model, no cfp): the reference."""
    graphdef, _ = nnx.split(LM(nnx.Rngs(0)))

    def step(state, opt_state, batch):
        def mean_loss(st):
            s, w = loss(nnx.merge(graphdef, st)(batch["inputs"]), batch)
            return s / w
        value, grads = jax.value_and_grad(mean_loss)(state)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, value
    return jax.jit(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    model, batch, tx = factory()
    layout = cfp.Layout.from_lists([[2, 1], [1, 1, 1]], [[4, 2], [1, 2, 3]], [8, 8], [4, 2])
    result = cfp.train_pipelines(model, tx, layout, batch, steps=a.steps, verify=True)
    print(f"cfp pipelines: losses {[round(v, 5) for v in result.losses.values()]} (measured), verify error "
          f"{result.verify_error:.2e} against the LayeredModel's own loss on one device")
    state = nnx.state(LM(nnx.Rngs(0)), nnx.Param)
    step, opt_state, rows = own_step(tx), tx.init(state), layout.global_batch
    for s in range(a.steps):
        b = {k: np.roll(v, -s * rows, axis=0)[:rows] for k, v in batch.items()}
        state, opt_state, value = step(state, opt_state, b)
        print(f"own unsharded step {s + 1}: loss {float(value):.5f} (measured)")


if __name__ == "__main__":
    main()
