"""Training steps as users write them, shared by the test modules (scan, remat, explain): a model's next-token
step with an optax optimizer, a loop that runs a step several times, and a layer stack scanned or unrolled."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


class MlpBlock(nn.Module):
    """A pre-norm residual MLP layer, written as a scan body `(x, _) -> (x, None)`."""

    dim: int

    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(4 * self.dim, use_bias=False)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim, use_bias=False)(nn.gelu(h)), None


class MlpStack(nn.Module):
    """Embedding, `layers` `MlpBlock`s and a head: stacked and applied by `nn.scan` (`scanned`), or unrolled
    (one module per layer); `remat` wraps the block in `nn.remat` (inside the scan when scanned)."""

    vocab: int
    dim: int
    layers: int
    scanned: bool
    remat: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        block = nn.remat(MlpBlock) if self.remat else MlpBlock
        if self.scanned:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
            x, _ = stack(self.dim, name="layers")(x, None)
        else:
            for i in range(self.layers):
                x, _ = block(self.dim, name=f"layers_{i}")(x, None)
        return nn.Dense(self.vocab, use_bias=False)(x)


def lm_step_problem(model, optimizer, batch: int, seq: int, vocab: int):
    """(step, (params, opt_state, x, y)) of `model` (a Flax module, tokens -> logits) trained by `optimizer` on
    next-token cross-entropy, written `(params, opt_state, x, y) -> (loss, params, opt_state)`."""
    def step(params, opt_state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq + 1), 0, vocab)
    params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])
    return step, (params, optimizer.init(params), tokens[:, :-1], tokens[:, 1:])


def train(step, args, steps: int):
    """(losses, params, opt_state) after `steps` calls of `step` from `args` (params, opt_state, x, y), each
    call fed the previous one's state; a NaN or Inf loss fails."""
    params, opt_state, x, y = args
    losses = []
    for _ in range(steps):
        loss, params, opt_state = step(params, opt_state, x, y)
        losses.append(float(loss))
    assert np.isfinite(losses).all(), f"non-finite losses {losses}"
    return np.array(losses), params, opt_state


def two_layer_mlp():
    """(params, x, y, loss) of a small seeded tanh MLP regression (32 -> 64 -> 32 features, 64 rows)."""
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"w1": jax.random.normal(k[0], (32, 64)) * .1, "w2": jax.random.normal(k[1], (64, 32)) * .1}

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)
    return p, jax.random.normal(k[2], (64, 32)), jax.random.normal(k[3], (64, 32)), loss


def zoo_cache(model: str, cfg, learning_rate: float = 1e-3, weight_decay: float = 0.01, seed: int = 0):
    """A compile cache of the zoo model's `LayeredModel` (parameters of `seed`) with AdamW: what a zoo run trains."""
    from cfp.models.layered import zoo_model
    from cfp.runtime.engine import adamw
    from cfp.runtime.stage.cache import CompileCache
    return CompileCache(zoo_model(model, cfg, seed), adamw(learning_rate, weight_decay))


def zoo_batch(model: str, cfg, rows: int = 1, seed: int = 0):
    """A zoo batch as host numpy (its shapes are what stage programs are built for)."""
    from cfp.models import make_batch
    return jax.tree_util.tree_map(np.asarray, make_batch(model, cfg, rows, seed))


def trainer_of(cache, layout, schedule="gpipe", plans=None, example=None):
    """A `HeteroTrainer` of `cache`'s model and optimizer (the zoo's example batch when not given)."""
    from cfp.runtime.engine import HeteroTrainer
    cfg = cache.model.config
    example = example if example is not None else zoo_batch(cache.model.name, cfg)
    return HeteroTrainer(cache.model, None, layout, schedule, plans=plans, cache=cache, example_batch=example)
