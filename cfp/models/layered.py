"""The zoo's models as `LayeredModel`s: the same contract a user's model meets, so the planner and the pipeline
runtime have one path for both.

The activation is ``{"h": hidden [B,S,H], "aux": the MoE aux loss summed so far}`` and, for packed
variable-length rows, the batch's ``segment_ids`` and ``positions`` ([B,S] int32, carried to every layer's
attention; they get no gradient). ``last`` returns ``sum(ce * w) + aux_loss_coef * aux * sum(w)`` and
``sum(w)``: the batch's loss is the token-weighted mean cross-entropy plus the coefficient times the aux loss,
as ``cfp.models.loss_fn`` computes it on one device. Parameters keep the zoo's module trees (``embed``,
``layers_i``, ``head``) as ``first``, ``layers[i]``, ``last``; their logical dim names come from
`cfp.models.dims`.
"""
from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp
import optax

from cfp.layered.model import LayeredModel
from cfp.models.configs import Config, MoEConfig
from cfp.models.dims import param_dims
from cfp.models.zoo import _resolve, init_params, stage_modules
from cfp.sharding.rules import path_keys

PACKED_KEYS = ("segment_ids", "positions")


def zoo_params(full: Any, num_layers: int) -> dict:
    """``{"params": {"embed", "layers_i", "head"}}`` (``init_params``) as a layered model's parameters."""
    p = full["params"]
    return {"first": p["embed"], "layers": [p[f"layers_{i}"] for i in range(num_layers)], "last": p["head"]}


def zoo_full_params(params: Any) -> dict:
    """The inverse of `zoo_params`: the layered parameters as the zoo model's ``{"params": ...}`` tree."""
    tree = {"embed": params["first"], "head": params["last"]}
    tree.update({f"layers_{i}": p for i, p in enumerate(params["layers"])})
    return {"params": tree}


def zoo_model(model_name: str, config: Union[Config, str, None] = None, seed: Any = 0, *,
              abstract: bool = False) -> LayeredModel:
    """``model_name``'s `LayeredModel`, parameters initialised like ``train_step(...).init(seed)`` (abstract:
    ShapeDtypeStructs, nothing allocated)."""
    cfg = _resolve(model_name, config)
    embed, layers, head = stage_modules(model_name, cfg)
    init = lambda: init_params(model_name, cfg, seed)
    full = jax.eval_shape(init) if abstract else init()
    params = zoo_params(full, cfg.num_layers)
    names = jax.tree_util.tree_map_with_path(lambda path, a: param_dims(path_keys(path), len(a.shape)), params)
    coef = float(getattr(cfg, "aux_loss_coef", 0.0))

    def first(p, batch):
        packed = "segment_ids" in batch
        h = embed.apply({"params": p}, batch["inputs"], **({"positions": batch["positions"]} if packed else {}))
        x = {"h": h, "aux": jnp.zeros((), jnp.float32)}
        return x | ({k: batch[k] for k in PACKED_KEYS} if packed else {})

    def last(p, x, batch):
        logits = head.apply({"params": p}, x["h"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
        w = batch["weights"].astype(jnp.float32)
        total = jnp.sum(w)
        loss_sum = jnp.sum(ce * w)
        return (loss_sum + coef * x["aux"] * total if coef else loss_sum), total

    # dense models repeat one layer; MoE alternates a dense and an expert layer (two functions)
    kinds = 2 if isinstance(cfg, MoEConfig) else 1
    fns = [_layer_fn(layers[k]) for k in range(kinds)]
    layer = fns[0] if kinds == 1 else [fns[i % kinds] for i in range(cfg.num_layers)]
    heads = (cfg.num_heads, getattr(cfg, "num_kv_heads", cfg.num_heads))
    return LayeredModel(first=first, layer=layer, last=last, params=params, logical_names=names,
                        name=model_name, heads=heads, config=cfg)


def _layer_fn(module):
    def layer(p, x):
        kw = {k: x[k] for k in PACKED_KEYS if k in x}
        h, aux = module.apply({"params": p}, x["h"], **kw)
        return x | {"h": h, "aux": x["aux"] + aux.astype(jnp.float32)}
    return layer
