"""A plain-JAX MLP-Mixer (Tolstikhin et al., 2021) written as a `cfp.LayeredModel`, as a user would: no Flax, its
layers' parameters stacked on a leading layer dim (as `nn.scan` makes them), no logical names unless asked for.

``make()`` is a `cfp plan --model tests/layered_mixer.py:make` factory: (model, batch, optimizer).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cfp.layered.model import LayeredModel

PATCHES, PATCH_DIM, CHANNELS, TOKEN_HIDDEN, CHANNEL_HIDDEN, CLASSES = 64, 48, 128, 128, 512, 16


def _dense(key, n_in, n_out):
    return {"kernel": jax.random.normal(key, (n_in, n_out), jnp.float32) / np.sqrt(n_in),
            "bias": jnp.zeros((n_out,), jnp.float32)}


def _norm(dim):
    return {"scale": jnp.ones((dim,), jnp.float32), "bias": jnp.zeros((dim,), jnp.float32)}


def _layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]


def _mlp(p1, p2, x):
    return jax.nn.gelu(x @ p1["kernel"] + p1["bias"]) @ p2["kernel"] + p2["bias"]


def init(key, layers: int, patches=PATCHES, channels=CHANNELS, token_hidden=TOKEN_HIDDEN,
         channel_hidden=CHANNEL_HIDDEN):
    k = jax.random.split(key, 4 * layers + 2)

    def layer(i):
        return {"norm1": _norm(channels), "tok1": _dense(k[4 * i], patches, token_hidden),
                "tok2": _dense(k[4 * i + 1], token_hidden, patches), "norm2": _norm(channels),
                "ch1": _dense(k[4 * i + 2], channels, channel_hidden),
                "ch2": _dense(k[4 * i + 3], channel_hidden, channels)}
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[layer(i) for i in range(layers)])
    return {"first": {"stem": _dense(k[-2], PATCH_DIM, channels)}, "layers": stacked,
            "last": {"norm": _norm(channels), "head": _dense(k[-1], channels, CLASSES)}}


def first(p, batch):
    """Patches [B, P, patch dim] -> channels [B, P, C]."""
    return batch["patches"] @ p["stem"]["kernel"] + p["stem"]["bias"]


def layer(p, x):
    y = _layer_norm(p["norm1"], x).transpose(0, 2, 1)               # [B, C, P]: mix the patches
    x = x + _mlp(p["tok1"], p["tok2"], y).transpose(0, 2, 1)
    return x + _mlp(p["ch1"], p["ch2"], _layer_norm(p["norm2"], x))  # mix the channels


def last(p, x, batch):
    logits = _layer_norm(p["norm"], x).mean(1) @ p["head"]["kernel"] + p["head"]["bias"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return ce.sum(), jnp.asarray(ce.shape[0], jnp.float32)


def names(layers_stacked: bool = True):
    """Logical dim names in cfp's vocabulary (`cfp.models.dims`): the channel MLP is Megatron's (its hidden units
    "mlp"), the patch-mixing MLP and the rest replicated."""
    lead = ("layers",) if layers_stacked else ()
    dense = lambda a, b: {"kernel": lead + (a, b), "bias": lead + (b,)}
    norm = {"scale": lead + (None,), "bias": lead + (None,)}
    return {"first": {"stem": {"kernel": (None, None), "bias": (None,)}},
            "layers": {"norm1": norm, "tok1": dense(None, None), "tok2": dense(None, None), "norm2": norm,
                       "ch1": dense("embed", "mlp"), "ch2": {"kernel": lead + ("mlp", "embed"), "bias": lead + (None,)}},
            "last": {"norm": {"scale": (None,), "bias": (None,)}, "head": {"kernel": (None, None), "bias": (None,)}}}


def model(layers: int = 4, named: bool = False, seed: int = 0, **dims) -> LayeredModel:
    """`dims`: `init`'s patches, channels, token_hidden, channel_hidden (default: the module's sizes)."""
    return LayeredModel(first=first, layer=layer, last=last, params=init(jax.random.PRNGKey(seed), layers, **dims),
                        logical_names=names() if named else None, name="mlp-mixer")


def batch(rows: int, seed: int = 1, patches: int = PATCHES) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"patches": np.asarray(jax.random.normal(k1, (rows, patches, PATCH_DIM), jnp.float32)),
            "labels": np.asarray(jax.random.randint(k2, (rows,), 0, CLASSES, jnp.int32))}


def make():
    """The `--model tests/layered_mixer.py:make` factory: 8 layers, 64 rows of data, AdamW."""
    return model(8), batch(64), optax.adamw(1e-3)


def make_bench():
    """A larger mixer for `benchmarks/planner_user_model.py` (8 layers of 128 patches x 256 channels, MLPs of 256
    and 1024 units): enough work per program that the runtime's dispatch between programs, which the cost model
    leaves out, is a small part of a step."""
    dims = dict(patches=128, channels=256, token_hidden=256, channel_hidden=1024)
    return model(8, **dims), batch(64, patches=dims["patches"]), optax.adamw(1e-3)
