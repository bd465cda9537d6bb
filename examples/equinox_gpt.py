"""An Equinox GPT trained with optax AdamW, sharded by cfp and run as a chained training loop.

    python examples/equinox_gpt.py [--steps 5] [--plan equinox_plan.json]

The step is written as Equinox's own examples write it: `(params, x, y, opt_state) -> (loss, params,
opt_state)` over `eqx.partition`ed arrays. cfp finds the state (params, optimizer state) from the program,
takes any mesh (`jax.make_mesh` gives Explicit axes), and returns a step whose state outputs keep their
inputs' shardings, so the loop feeds them back in with their buffers donated.
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import cfp  # noqa: E402

VOCAB, DIM, SEQ, HEADS, LAYERS, BATCH = 128, 64, 16, 4, 2, 16


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.up, self.down = eqx.nn.Linear(DIM, 4 * DIM, key=k2), eqx.nn.Linear(4 * DIM, DIM, key=k3)

    def __call__(self, x):                       # x: [SEQ, DIM], one sequence (batched with vmap)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((SEQ, SEQ), bool)))
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x))))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, LAYERS + 2)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=ks[0])
        self.pos = 0.02 * jax.random.normal(ks[1], (SEQ, DIM))
        self.blocks = [Block(k) for k in ks[2:]]
        self.head = eqx.nn.Linear(DIM, VOCAB, key=ks[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


optimizer = optax.adamw(1e-3)


def problem(seed: int = 0):
    """(train_step, (params, x, y, opt_state), static): the step and its example arguments."""
    model = GPT(jax.random.PRNGKey(seed))
    params, static = eqx.partition(model, eqx.is_array)

    def loss_fn(params, x, y):
        logits = jax.vmap(eqx.combine(params, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(params, x, y, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (BATCH, SEQ + 1), 0, VOCAB)
    return train_step, (params, tokens[:, :-1], tokens[:, 1:], optimizer.init(params)), static


def train(step, args, steps: int):
    """Run `steps` steps feeding the state outputs back in; returns (losses, params, opt_state)."""
    params, x, y, opt_state = args
    losses = []
    for _ in range(steps):
        loss, params, opt_state = step(params, x, y, opt_state)
        losses.append(float(loss))
    return losses, params, opt_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plan", default="equinox_plan.json", help="where to save the plan")
    p.add_argument("--profiler", choices=("measure", "estimate"), default="measure",
                   help="measure: time plans on these devices; estimate: the A100-SXM-80G cost model (quick)")
    p.add_argument("--verify", type=int, default=cfp.SearchOptions().verify,
                   help="the search's best plans compiled whole and timed side by side (0: trust the profiles; "
                        "default %(default)s)")
    a = p.parse_args()
    if a.verify < 0:
        p.error(f"--verify {a.verify} must be >= 0")
    train_step, args, _ = problem()
    mesh = jax.make_mesh((2, 4), ("data", "model"))          # Explicit axes, as current JAX makes them
    step = cfp.autoshard(train_step, mesh, *args, donate=True, plan_out=a.plan, iters=3, max_combinations=4,
                         verify=a.verify, profiler=a.profiler, gpu="A100-SXM-80G" if a.profiler == "estimate" else None)
    print(step.search.report(*(("estimated: A100-SXM-80G cost model", "compiled on this host")
                               if a.profiler == "estimate" else ())))
    print(f"plan saved to {a.plan}")
    losses, _, _ = train(step, step.shard_args(*args), a.steps)
    print("losses (measured):", " ".join(f"{v:.4f}" for v in losses))


if __name__ == "__main__":
    main()
