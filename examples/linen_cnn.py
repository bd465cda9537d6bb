"""A Flax Linen CNN with BatchNorm, trained with SGD + momentum, sharded by cfp and run as a chained loop.

    python examples/linen_cnn.py [--steps 5] [--plan cnn_plan.json]

Not a transformer: convolutions, BatchNorm's running statistics (a `mutable` collection the step returns
updated beside the parameters) and a flatten before the classifier. cfp's ParallelBlocks form around the dense
layers' dots (a convolution is not a block of its own); the convolutions and BatchNorm follow the sharding the
plan gives the images: split on the batch under a data-parallel plan, replicated under one that splits the first
dense layer's features. The running statistics are state like the parameters: found from the program, donated,
and returned with their inputs' shardings. The step is
`(params, batch_stats, opt_state, x, y) -> (loss, params, batch_stats, opt_state)`.
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import cfp  # noqa: E402

IMAGE, CLASSES, BATCH = 16, 10, 32


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for features in (16, 32):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(CLASSES)(x)


model = CNN()
optimizer = optax.sgd(0.05, momentum=0.9)


def train_step(params, batch_stats, opt_state, x, y):
    def loss_fn(params):
        logits, new = model.apply({"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), batch_stats, opt_state


def problem(seed: int = 0):
    """(train_step, (params, batch_stats, opt_state, x, y), None)."""
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (BATCH, IMAGE, IMAGE, 3))
    y = jax.random.randint(jax.random.PRNGKey(seed + 2), (BATCH,), 0, CLASSES)
    variables = model.init(jax.random.PRNGKey(seed), x)
    params = variables["params"]
    return train_step, (params, variables["batch_stats"], optimizer.init(params), x, y), None


def train(step, args, steps: int):
    """Run `steps` steps feeding the state outputs back in; returns (losses, params, batch_stats, opt_state)."""
    params, batch_stats, opt_state, x, y = args
    losses = []
    for _ in range(steps):
        loss, params, batch_stats, opt_state = step(params, batch_stats, opt_state, x, y)
        losses.append(float(loss))
    return losses, params, batch_stats, opt_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plan", default="cnn_plan.json", help="where to save the plan")
    p.add_argument("--profiler", choices=("measure", "estimate"), default="measure",
                   help="measure: time plans on these devices; estimate: the A100-SXM-80G cost model (quick)")
    p.add_argument("--verify", type=int, default=cfp.SearchOptions().verify,
                   help="the search's best plans compiled whole and timed side by side (0: trust the profiles; "
                        "default %(default)s)")
    a = p.parse_args()
    if a.verify < 0:
        p.error(f"--verify {a.verify} must be >= 0")
    _, args, _ = problem()
    gpu = "A100-SXM-80G" if a.profiler == "estimate" else None
    step = cfp.autoshard(train_step, jax.make_mesh((2, 4), ("data", "model")), *args, donate=True,
                         plan_out=a.plan, iters=3, max_combinations=4, verify=a.verify, profiler=a.profiler, gpu=gpu)
    print(step.search.report(*(("estimated: A100-SXM-80G cost model", "compiled on this host") if gpu else ())))
    print(f"plan saved to {a.plan}; {len(step.analysis.blocks)} ParallelBlocks")
    losses = train(step, step.shard_args(*args), a.steps)[0]
    print("losses (measured):", " ".join(f"{v:.4f}" for v in losses))


if __name__ == "__main__":
    main()
