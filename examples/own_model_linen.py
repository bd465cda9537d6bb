"""Your own model on mixed GPUs, Flax Linen style: a transformer whose layers `nn.scan` stacks, its parameters named
with `nn.with_logical_partitioning`, planned for a cluster file and trained by cfp on a heterogeneous layout of
pipelines, checked against the model's own unsharded training step.

    python examples/own_model_linen.py [--steps 3]
    cfp plan --cluster examples/clusters/local.yaml --model examples/own_model_linen.py:factory --out linen.json
    cfp train --model examples/own_model_linen.py:factory --layout linen.json --steps 3 --verify

`factory()` is what `--model` calls: it returns the model as a `cfp.LayeredModel` (`cfp.from_linen` splits the
Linen parameters into embedding, stacked layers and head), the training data and the optax optimizer.
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import cfp  # noqa: E402

VOCAB, DIM, SEQ, HEADS, LAYERS, ROWS = 256, 64, 32, 4, 6, 64
named = nn.with_logical_partitioning
init = nn.initializers.lecun_normal()


class Embed(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        table = self.param("table", named(nn.initializers.normal(0.02), ("vocab", "embed")), (VOCAB, DIM))
        return table[tokens]


class Block(nn.Module):
    """Pre-LN attention and MLP; an `nn.scan` body: ``(x, _) -> (x, None)``."""

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm(use_bias=False)(x)
        qkv = nn.DenseGeneral((3, HEADS, DIM // HEADS), use_bias=False,
                              kernel_init=named(init, ("embed", None, "heads", "kv")))(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        a = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(x[..., 0]))
        x = x + nn.DenseGeneral(DIM, axis=(-2, -1), use_bias=False,
                                kernel_init=named(init, ("heads", "kv", "embed")))(a)
        h = nn.Dense(4 * DIM, use_bias=False, kernel_init=named(init, ("embed", "mlp")))(nn.LayerNorm(use_bias=False)(x))
        return x + nn.Dense(DIM, use_bias=False, kernel_init=named(init, ("mlp", "embed")))(nn.gelu(h)), None


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(VOCAB, use_bias=False, kernel_init=named(init, ("embed", "vocab")))(nn.LayerNorm()(x))


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = Embed(name="embed")(tokens)
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = layers(name="layers")(x, None)
        return Head(name="head")(x)


def loss(logits, batch):
    """Token cross-entropy summed over the batch, and its token count."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return jnp.sum(ce), jnp.float32(ce.size)


def data(seed: int = 0) -> dict:
    """ROWS sequences of SEQ next-token pairs from a fixed random source (step s trains on rows s*B..)."""
    toks = np.random.default_rng(seed).integers(0, VOCAB, (ROWS, SEQ + 1), dtype=np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def optimizer() -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=50)
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.1))


def variables(seed: int = 0):
    return LM().init(jax.random.PRNGKey(seed), data()["inputs"][:1])


def factory():
    """(LayeredModel, batch, optimizer): what `--model examples/own_model_linen.py:factory` calls."""
    model = cfp.from_linen(Embed(), Block(), Head(), variables()["params"], loss, inputs="inputs", name="linen-lm")
    return model, data(), optimizer()


def own_step(tx):
    """The user's own training step on one device (the whole LM, no cfp): the reference cfp is checked against."""
    def step(params, opt_state, batch):
        def mean_loss(p):
            s, w = loss(LM().apply({"params": p}, batch["inputs"]), batch)
            return s / w
        value, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return jax.jit(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    model, batch, tx = factory()
    # two pipelines of unequal stages: TP 2 then TP 1 (4 + 2 layers), and three TP 1 stages (1 + 2 + 3 layers)
    layout = cfp.Layout.from_lists([[2, 1], [1, 1, 1]], [[4, 2], [1, 2, 3]], [8, 8], [4, 2])
    result = cfp.train_pipelines(model, tx, layout, batch, steps=a.steps, verify=True)
    print(f"cfp pipelines: losses {[round(v, 5) for v in result.losses.values()]} (measured), verify error "
          f"{result.verify_error:.2e} against the LayeredModel's own loss on one device")
    params = nn.meta.unbox(variables()["params"])
    step, opt_state, rows = own_step(tx), tx.init(params), layout.global_batch
    for s in range(a.steps):
        b = {k: np.roll(v, -s * rows, axis=0)[:rows] for k, v in batch.items()}
        params, opt_state, value = step(params, opt_state, b)
        print(f"own unsharded step {s + 1}: loss {float(value):.5f} (measured)")


if __name__ == "__main__":
    main()
