"""The benchmarks' shared pieces: one timing loop, sharded steps timed side by side (every step in turn in each
round, see `cfp.xla.compiled.time_interleaved`) so a burst of load on a shared host lands on all of them alike;
and one language-model training step builder (`lm_step_problem`).

    from side_by_side import time_side_by_side      # benchmarks/ is on sys.path when a benchmark runs
"""
from collections.abc import Mapping

import jax

from cfp.xla.compiled import time_interleaved


def time_side_by_side(steps: Mapping, args, rounds: int, warmup: int = 2) -> dict:
    """name -> (median wall seconds, relative noise) of each `ShardedStep` in `steps` (measured). `args`: the
    step arguments, one tuple for all or a mapping name -> tuple; each run gets them freshly placed with its
    step's input shardings (only one step's placed arguments live at a time)."""
    def args_of(name):
        return args[name] if isinstance(args, Mapping) else args
    runs = [(s.compile(*args_of(k)), lambda s=s, k=k: jax.tree_util.tree_leaves(s.shard_args(*args_of(k))))
            for k, s in steps.items()]
    return dict(zip(steps, time_interleaved(runs, rounds, warmup)))


def lm_step_problem(model, optimizer, batch: int, seq: int, vocab: int):
    """(step, (params, opt_state, x, y)) of `model` (a Flax module, tokens -> logits) trained by `optimizer` on
    next-token cross-entropy, written `(params, opt_state, x, y) -> (loss, params, opt_state)`."""
    import optax

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq + 1), 0, vocab)
    params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])
    return step, (params, optimizer.init(params), tokens[:, :-1], tokens[:, 1:])
