"""`LayeredModel`s from the models JAX users write: Flax Linen, Flax NNX and Equinox, with per-layer submodules or
layers stacked on a leading dim (``nn.scan``, ``nnx.vmap``, ``eqx.filter_vmap``). The user names the model's
three parts -- its embedding, its repeated layers and its head -- and gives the loss on the head's output; the
helper splits the parameters, keeps their logical dim names (``nn.with_logical_partitioning``,
``nnx.with_partitioning``) and checks the contract on an example batch, so the user writes no stacking or splitting
code.

Common arguments: ``loss(outputs, batch) -> (loss_sum, weight)`` (the head's output; summed over the batch, and
its weight, e.g. its token count); ``inputs``: what the embedding takes from a batch (a key of a dict batch, or a
function of the batch; default ``"inputs"``). A layer may return its activation or, as an ``nn.scan`` body does,
``(activation, anything)``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import jax
import numpy as np

from cfp.errors import ConfigError
from cfp.layered.model import LayeredModel

Inputs = Union[str, Callable[[Any], Any]]


def _inputs_of(inputs: Inputs) -> Callable[[Any], Any]:
    if callable(inputs):
        return inputs

    def pick(batch):
        if not isinstance(batch, dict) or inputs not in batch:
            raise ConfigError(f"inputs={inputs!r}: the batch has no key {inputs!r}; pass inputs= the key of the "
                              "embedding's input, or a function of the batch")
        return batch[inputs]
    return pick


def _carry(out: Any, x: Any) -> Any:
    """A layer's activation: ``out``, or ``out[0]`` for a scan body's ``(carry, y)``."""
    if isinstance(out, tuple) and len(out) == 2 and not (isinstance(x, tuple) and len(x) == 2):
        return out[0]
    return out


def _stack_names(names: Any, params: Any) -> Any:
    """A stacked leaf's logical names with its layer dim first (``None``) where the names leave it out."""
    return jax.tree_util.tree_map(
        lambda n, a: n if n is None or len(n) == np.ndim(a) else (None,) + tuple(n), names, params,
        is_leaf=lambda n: n is None or isinstance(n, tuple))


def _layer_keys(tree: dict, name: str, where: str) -> tuple[Any, bool]:
    """(layers, stacked): ``tree[name]`` stacked, or ``tree[f"{name}_0"], ...`` per layer (Linen's list naming)."""
    if name in tree:
        return tree[name], True
    keys = sorted((k for k in tree if isinstance(k, str) and k.startswith(f"{name}_") and k[len(name) + 1:].isdigit()),
                  key=lambda k: int(k[len(name) + 1:]))
    if not keys:
        raise ConfigError(f"{where} has no {name!r} (stacked layers) nor {name}_0, {name}_1, ... (one per layer); "
                          f"its keys: {sorted(map(str, tree))}")
    return [tree[k] for k in keys], False


# ---------------------------------------------------------------------------------------------------- Linen
def from_linen(embed: Any, layer: Any, head: Any, params: dict, loss: Callable, *, inputs: Inputs = "inputs",
               names: Sequence[str] = ("embed", "layers", "head"), name: str = "linen") -> LayeredModel:
    """A Linen model as a `LayeredModel`: ``embed``, ``layer`` and ``head`` are the (unbound) module instances of its
    parts, ``params`` the whole model's ``variables["params"]`` (boxed by ``nn.with_logical_partitioning`` or not),
    in which the parts sit under ``names``: the layers stacked under ``names[1]`` (``nn.scan``) or one per layer under
    ``names[1]_0``, ``names[1]_1``, ... (a list of submodules)."""
    import flax.linen as nn
    e, l, h = names
    boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)
    logical = jax.tree_util.tree_map(lambda x: tuple(x.names) if isinstance(x, nn.LogicallyPartitioned) or (
        isinstance(x, nn.Partitioned)) else None, params, is_leaf=boxed)
    plain = nn.meta.unbox(params)
    for key in (e, h):
        if key not in plain:
            raise ConfigError(f"from_linen: params have no {key!r}; their keys: {sorted(plain)} (pass names=)")
    layers, stacked = _layer_keys(plain, l, "from_linen: params")
    layer_names, _ = _layer_keys(logical, l, "from_linen: params")
    get = _inputs_of(inputs)
    tree = {"first": plain[e], "layers": layers, "last": plain[h]}
    names_tree = {"first": logical[e], "layers": _stack_names(layer_names, layers) if stacked else layer_names,
                  "last": logical[h]}
    has_names = any(n is not None for n in jax.tree_util.tree_leaves(
        names_tree, is_leaf=lambda n: n is None or isinstance(n, tuple)))
    # an `nn.scan` body takes (carry, scanned input): the layers run without scanned inputs
    call = (lambda p, x: layer.apply({"params": p}, x, None)) if stacked else (lambda p, x: layer.apply({"params": p}, x))
    return LayeredModel(
        first=lambda p, batch: embed.apply({"params": p}, get(batch)),
        layer=lambda p, x: _carry(call(p, x), x),
        last=lambda p, x, batch: loss(head.apply({"params": p}, x), batch),
        params=tree, logical_names=names_tree if has_names else None, name=name)


# ---------------------------------------------------------------------------------------------------- NNX
def from_nnx(model: Any, loss: Callable, *, inputs: Inputs = "inputs",
             names: Sequence[str] = ("embed", "layers", "head"), name: str = "nnx") -> LayeredModel:
    """An NNX model as a `LayeredModel`: its attributes ``names`` are the embedding, the layers (a list of modules,
    or one module whose parameters ``nnx.vmap`` stacked on a leading dim) and the head. Parameters become plain
    dicts (``nnx.to_pure_dict``); logical names come from ``nnx.with_partitioning``."""
    from flax import nnx
    e, l, h = names
    parts = {}
    for key in names:
        if not hasattr(model, key):
            raise ConfigError(f"from_nnx: the model ({type(model).__name__}) has no attribute {key!r} (pass names=)")
        parts[key] = getattr(model, key)
    split = lambda m: nnx.split(m)
    pure = lambda m: nnx.to_pure_dict(nnx.state(m))
    specs = lambda m: jax.tree_util.tree_map(
        lambda s: tuple(s) if len(s) else None, nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(m))),
        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    stacked = not isinstance(parts[l], (list, tuple)) and not isinstance(parts[l], nnx.List) \
        if hasattr(nnx, "List") else not isinstance(parts[l], (list, tuple))
    layer_mods = [parts[l]] if stacked else list(parts[l])
    g_e, g_l, g_h = split(parts[e])[0], split(layer_mods[0])[0], split(parts[h])[0]
    layers = pure(parts[l]) if stacked else [pure(m) for m in layer_mods]
    layer_names = _stack_names(specs(parts[l]), layers) if stacked else [specs(m) for m in layer_mods]
    names_tree = {"first": specs(parts[e]), "layers": layer_names, "last": specs(parts[h])}
    has_names = any(n is not None for n in jax.tree_util.tree_leaves(
        names_tree, is_leaf=lambda n: n is None or isinstance(n, tuple)))
    get = _inputs_of(inputs)
    call = lambda g, p, *a: nnx.merge(g, nnx.State(p))(*a)
    return LayeredModel(
        first=lambda p, batch: call(g_e, p, get(batch)),
        layer=lambda p, x: _carry(call(g_l, p, x), x),
        last=lambda p, x, batch: loss(call(g_h, p, x), batch),
        params={"first": pure(parts[e]), "layers": layers, "last": pure(parts[h])},
        logical_names=names_tree if has_names else None, name=name)


# ---------------------------------------------------------------------------------------------------- Equinox
def from_equinox(model: Any, loss: Callable, *, inputs: Inputs = "inputs",
                 names: Sequence[str] = ("embed", "layers", "head"), name: str = "equinox") -> LayeredModel:
    """An Equinox model as a `LayeredModel`: its fields ``names`` are the embedding, the layers (a list of modules,
    or one module whose arrays ``eqx.filter_vmap`` stacked on a leading dim) and the head. The parameters are the
    modules' arrays (``eqx.partition(..., eqx.is_array)``); Equinox has no logical names, so tensor-parallel stages
    take searched stage plans."""
    import equinox as eqx
    e, l, h = names
    for key in names:
        if not hasattr(model, key):
            raise ConfigError(f"from_equinox: the model ({type(model).__name__}) has no field {key!r} (pass names=)")
    parts = {k: getattr(model, k) for k in names}
    stacked = not isinstance(parts[l], (list, tuple))
    part = lambda m: eqx.partition(m, eqx.is_array)
    (p_e, s_e), (p_h, s_h) = part(parts[e]), part(parts[h])
    if stacked:
        layers, s_l = part(parts[l])
    else:
        splits = [part(m) for m in parts[l]]
        layers, s_l = [p for p, _ in splits], splits[0][1]
    get = _inputs_of(inputs)
    return LayeredModel(
        first=lambda p, batch: eqx.combine(p, s_e)(get(batch)),
        layer=lambda p, x: _carry(eqx.combine(p, s_l)(x), x),
        last=lambda p, x, batch: loss(eqx.combine(p, s_h)(x), batch),
        params={"first": p_e, "layers": layers, "last": p_h}, name=name)
