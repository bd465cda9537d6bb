"""A Flax Linen transformer whose layers are stacked and applied with `nn.scan`, sharded by cfp and run as a
chained training loop with optax Adam.

    python examples/scanned_linen.py [--steps 5] [--plan scanned_plan.json]

Large JAX models scan over stacked layers to keep compile time flat with depth. cfp sees through the scan:
the body's blocks are one segment, profiled once whatever the depth, the plan's constraints are applied
inside the loop, and the stacked parameters (and their Adam moments) keep the layer dim whole. The step is
the usual `(params, opt_state, x, y) -> (loss, params, opt_state)`; its state outputs keep their inputs'
shardings, so the loop feeds them back in, donated.
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import cfp  # noqa: E402

VOCAB, DIM, SEQ, HEADS, LAYERS, BATCH = 128, 64, 16, 4, 4, 16


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        # no biases: a key bias has zero gradient in exact arithmetic (softmax ignores it), and Adam would
        # turn its rounding noise into full-size steps that no two summation orders reproduce
        x = x + nn.MultiHeadDotProductAttention(HEADS, deterministic=True, use_bias=False)(
            h, mask=nn.make_causal_mask(x[..., 0]))
        h = nn.Dense(4 * DIM)(nn.LayerNorm()(x))
        return x + nn.Dense(DIM)(nn.gelu(h)), None


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM)(tokens)
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        x, _ = layers(name="layers")(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


model = Transformer()
optimizer = optax.adam(1e-3)


def train_step(params, opt_state, x, y):
    def loss_fn(params):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def problem(seed: int = 0):
    """(train_step, (params, opt_state, x, y), None)."""
    tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (BATCH, SEQ + 1), 0, VOCAB)
    params = model.init(jax.random.PRNGKey(seed), tokens[:, :-1])
    return train_step, (params, optimizer.init(params), tokens[:, :-1], tokens[:, 1:]), None


def train(step, args, steps: int):
    """Run `steps` steps feeding the state outputs back in; returns (losses, params, opt_state)."""
    params, opt_state, x, y = args
    losses = []
    for _ in range(steps):
        loss, params, opt_state = step(params, opt_state, x, y)
        losses.append(float(loss))
    return losses, params, opt_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plan", default="scanned_plan.json", help="where to save the plan")
    p.add_argument("--profiler", choices=("measure", "estimate"), default="measure",
                   help="measure: time plans on these devices; estimate: the A100-SXM-80G cost model (quick)")
    p.add_argument("--verify", type=int, default=cfp.SearchOptions().verify,
                   help="the search's best plans compiled whole and timed side by side (0: trust the profiles; "
                        "default %(default)s)")
    a = p.parse_args()
    if a.verify < 0:
        p.error(f"--verify {a.verify} must be >= 0")
    _, args, _ = problem()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    step = cfp.autoshard(train_step, mesh, *args, donate=True, plan_out=a.plan, iters=3, max_combinations=4,
                         verify=a.verify, profiler=a.profiler, gpu="A100-SXM-80G" if a.profiler == "estimate" else None)
    print(step.search.report(*(("estimated: A100-SXM-80G cost model", "compiled on this host")
                               if a.profiler == "estimate" else ())))
    print(f"plan saved to {a.plan}")
    losses, _, _ = train(step, step.shard_args(*args), a.steps)
    print("losses (measured):", " ".join(f"{v:.4f}" for v in losses))


if __name__ == "__main__":
    main()
