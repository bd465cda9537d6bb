"""Model-zoo entry points: build models, make batches, losses and training steps."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import numbers
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from cfp.errors import ConfigError
from cfp.models.configs import CONFIG_CLASSES, MODEL_FAMILIES, Config, check_model_name, get_config


Batch = dict  # {"inputs": int32[B,S], "targets": int32[B,S], "weights": float32[B,S]}


def _resolve(model_name: str, config: Union[Config, str, None]) -> Config:
    check_model_name(model_name)
    if config is None or isinstance(config, str):
        return get_config(model_name, config or "tiny")
    want = CONFIG_CLASSES[model_name]
    if not isinstance(config, want):
        raise ConfigError(f"model {model_name!r} needs a {want.__name__}, got "
                          f"{type(config).__name__}")
    return config


def _module(model_name: str):
    return importlib.import_module(MODEL_FAMILIES[check_model_name(model_name)].module)


def build_model(model_name: str, config: Union[Config, str, None] = None):
    """Full flax ``Model`` for ``model_name``; ``apply(params, tokens) -> (logits, aux)``."""
    cfg = _resolve(model_name, config)
    return _module(model_name).Model(cfg)


def stage_modules(model_name: str, config: Union[Config, str, None] = None):
    """``(Embed, [Layer(cfg, 0), ..., Layer(cfg, L-1)], Head)`` for piecewise execution.

    Each module's params are the sub-tree ``params["params"][name]`` of the full model,
    with names ``embed``, ``layers_{i}``, ``head``.
    """
    cfg = _resolve(model_name, config)
    mod = _module(model_name)
    return mod.Embed(cfg), [mod.Layer(cfg, i) for i in range(cfg.num_layers)], mod.Head(cfg)


def min_batch_size(config: Config) -> int:
    """Smallest batch for which B*S tokens split into whole MoE groups (1 otherwise)."""
    g = getattr(config, "expert_group_size", None)
    return 1 if g is None else g // math.gcd(config.seq_len, g)


def init_params(model_name: str, config: Union[Config, str, None], rng) -> dict:
    """Initialise ``{"params": {...}}`` (float32) for the full model."""
    cfg = _resolve(model_name, config)
    tokens = jnp.zeros((min_batch_size(cfg), cfg.seq_len), jnp.int32)
    # jit: one compile is far cheaper than dispatching every init op eagerly.
    return jax.jit(build_model(model_name, cfg).init)(_key(rng), tokens)


def _key(rng):
    """An int seed (numpy ints included) or an existing PRNG key."""
    if isinstance(rng, numbers.Integral):
        return jax.random.PRNGKey(int(rng))
    return rng


def make_batch(model_name: str, config: Union[Config, str, None], batch_size: int,
               rng) -> Batch:
    """Random-token batch, deterministic in ``rng`` (a PRNGKey or an int seed).

    Causal models: targets are the next tokens, weights all 1.  BERT: masked positions
    (prob ``mask_prob``, at least one per sequence) become [MASK] in the inputs and carry
    weight 1; targets are the original tokens.
    """
    cfg = _resolve(model_name, config)
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) \
            or batch_size <= 0:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
    return _random_batch(model_name == "bert", cfg, int(batch_size), _key(rng))


# jit: a single compile instead of eagerly dispatching each random op.
@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _random_batch(masked_lm: bool, cfg: Config, b: int, key) -> Batch:
    k_tok, k_mask, k_force = jax.random.split(key, 3)
    s = cfg.seq_len
    if not masked_lm:
        toks = jax.random.randint(k_tok, (b, s + 1), 0, cfg.vocab_size, jnp.int32)
        return {"inputs": toks[:, :-1], "targets": toks[:, 1:],
                "weights": jnp.ones((b, s), jnp.float32)}
    # [MASK] is never drawn as a real token so masked inputs are unambiguous.
    toks = jax.random.randint(k_tok, (b, s), 0, cfg.mask_id, jnp.int32)
    mask = jax.random.uniform(k_mask, (b, s)) < cfg.mask_prob
    forced = jax.random.randint(k_force, (b, 1), 0, s)
    mask = mask | (jnp.arange(s)[None, :] == forced)
    return {"inputs": jnp.where(mask, cfg.mask_id, toks), "targets": toks,
            "weights": mask.astype(jnp.float32)}


def loss_fn(model_name: str, config: Union[Config, str, None] = None
            ) -> Callable[[Any, Batch], jnp.ndarray]:
    """``loss(params, batch)``: weighted mean token cross-entropy (+ coef * aux for MoE)."""
    cfg = _resolve(model_name, config)
    model = build_model(model_name, cfg)
    coef = getattr(cfg, "aux_loss_coef", 0.0)

    def loss(params, batch):
        logits, aux = model.apply(params, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["targets"])
        w = batch["weights"].astype(jnp.float32)
        # max() guards an all-zero weight batch (loss 0 instead of NaN).
        total = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-9)
        return total + coef * aux if coef else total

    return loss


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A model's training bundle.

    ``init(rng) -> (params, opt_state)``; ``step(params, opt_state, batch) ->
    (params, opt_state, loss)`` is pure and *not* jitted; ``loss(params, batch)``;
    ``make_batch(batch_size, rng) -> batch``.
    """
    model_name: str
    config: Config
    init: Callable
    step: Callable
    loss: Callable
    make_batch: Callable


def train_step(model_name: str, config: Union[Config, str, None] = None, *,
               learning_rate: float = 1e-3, weight_decay: float = 0.01,
               optimizer: Optional[optax.GradientTransformation] = None) -> TrainStep:
    """Bundle init / step / loss / make_batch for ``model_name`` (AdamW by default)."""
    cfg = _resolve(model_name, config)
    tx = optimizer if optimizer is not None else optax.adamw(learning_rate,
                                                             weight_decay=weight_decay)
    loss = loss_fn(model_name, cfg)

    def init(rng):
        params = init_params(model_name, cfg, rng)
        return params, tx.init(params)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def batch_fn(batch_size, rng):
        return make_batch(model_name, cfg, batch_size, rng)

    return TrainStep(model_name, cfg, init, step, loss, batch_fn)
