"""A Flax NNX transformer trained with `nnx.Optimizer`, sharded by cfp and run as a chained training loop.

    python examples/flax_nnx.py [--steps 5] [--plan nnx_plan.json]

NNX modules are stateful; cfp shards a pure function, so the step splits the model and optimizer into their
graph definition and `nnx.State` (`nnx.split`), and returns the new state (`nnx.state`). cfp finds that state
from the program, and the state outputs keep their inputs' shardings: the loop feeds them back in, donated.
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import cfp  # noqa: E402

VOCAB, DIM, SEQ, HEADS, LAYERS, BATCH = 128, 64, 16, 4, 2, 16


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        # no biases: a key bias has zero gradient in exact arithmetic (softmax ignores it), and Adam would
        # turn its rounding noise into full-size steps that no two summation orders reproduce
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, use_bias=False, rngs=rngs)
        self.up, self.down = nnx.Linear(DIM, 4 * DIM, rngs=rngs), nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def problem(seed: int = 0):
    """(train_step, (state, x, y), graphdef): the pure step over the model's and optimizer's `nnx.State`."""
    model = Transformer(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))

    def train_step(state, x, y):
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss, nnx.state((model, opt))

    tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (BATCH, SEQ + 1), 0, VOCAB)
    return train_step, (state, tokens[:, :-1], tokens[:, 1:]), graphdef


def train(step, args, steps: int):
    """Run `steps` steps feeding the new state back in; returns (losses, state)."""
    state, x, y = args
    losses = []
    for _ in range(steps):
        loss, state = step(state, x, y)
        losses.append(float(loss))
    return losses, state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plan", default="nnx_plan.json", help="where to save the plan")
    p.add_argument("--profiler", choices=("measure", "estimate"), default="measure",
                   help="measure: time plans on these devices; estimate: the A100-SXM-80G cost model (quick)")
    p.add_argument("--verify", type=int, default=cfp.SearchOptions().verify,
                   help="the search's best plans compiled whole and timed side by side (0: trust the profiles; "
                        "default %(default)s)")
    a = p.parse_args()
    if a.verify < 0:
        p.error(f"--verify {a.verify} must be >= 0")
    train_step, args, _ = problem()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    step = cfp.autoshard(train_step, mesh, *args, donate=True, plan_out=a.plan, iters=3, max_combinations=4,
                         verify=a.verify, profiler=a.profiler, gpu="A100-SXM-80G" if a.profiler == "estimate" else None)
    print(step.search.report(*(("estimated: A100-SXM-80G cost model", "compiled on this host")
                               if a.profiler == "estimate" else ())))
    print(f"plan saved to {a.plan}")
    losses, _ = train(step, step.shard_args(*args), a.steps)
    print("losses (measured):", " ".join(f"{v:.4f}" for v in losses))


if __name__ == "__main__":
    main()
