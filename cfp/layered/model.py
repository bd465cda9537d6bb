"""The layered-model contract: any JAX model as ``first -> layer x L -> last``, the unit the planner and the
pipeline runtime split into stages.

``LayeredModel(first=..., layer=..., last=..., params={"first": ..., "layers": ..., "last": ...})``:

* ``first(p_first, batch) -> x``: the embedding (any pytree ``x``; it may carry integer leaves such as
  segment ids, which travel with the activation and get no gradient);
* ``layer(p_layer, x) -> x``: one repeated layer, ``x`` of the same structure, shapes and dtypes in and out;
  ``p_layer`` is one layer's parameters. A sequence of L callables gives each layer its own function (layers
  of several kinds, e.g. dense and MoE in turn; list-form parameters only);
* ``last(p_last, x, batch) -> (loss_sum, weight)``: head and loss summed over the micro-batch, and its weight
  (e.g. its token count), both scalars.

``params["layers"]`` is a list of per-layer trees, or one stacked tree whose every leaf has a leading layer dim
(``nn.scan``, ``nnx.vmap``, ``eqx.filter_vmap``). The meaning on one device is fixed: the loss of a batch is
``sum(loss_sum) / sum(weight)`` over all its micro-batches and pipelines, its gradient that loss's gradient.

A batch is a pytree of arrays whose leaves share a leading batch dim (micro-batches are slices of it).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from cfp.errors import ConfigError

PARTS = ("first", "layers", "last")
LayerFn = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True, eq=False)
class LayeredModel:
    """A model as ``first -> layer x L -> last`` (see the module doc). ``logical_names``: per parameter leaf a
    tuple of logical dim names (``None`` for a dim no rule may shard; a stacked leaf's first name is its layer
    dim), the tree of ``params`` with tuples as leaves, as Flax's logical partitioning gives them; None: no
    names (tensor-parallel stages then take searched stage plans). ``heads``: (query, key/value) head counts of
    an attention that honours cfp's context-parallel scope (the zoo's); None: no context-parallel stages.
    ``config``: the zoo config the model was built from (None for a user's model), recorded with stage plans.
    Compared by identity (it holds functions and arrays)."""
    first: Callable[[Any, Any], Any]
    layer: Union[LayerFn, Sequence[LayerFn]]
    last: Callable[[Any, Any, Any], Any]
    params: Mapping[str, Any]
    logical_names: Optional[Mapping[str, Any]] = None
    name: str = "model"
    heads: Optional[tuple[int, int]] = None
    config: Any = None

    def __post_init__(self):
        for f in ("first", "last"):
            if not callable(getattr(self, f)):
                raise ConfigError(f"LayeredModel.{f}={getattr(self, f)!r} must be callable")
        if not isinstance(self.params, Mapping) or set(self.params) != set(PARTS):
            keys = sorted(self.params) if isinstance(self.params, Mapping) else type(self.params).__name__
            raise ConfigError(f"LayeredModel.params has keys {keys}; it needs exactly {list(PARTS)}")
        object.__setattr__(self, "params", dict(self.params))
        n = _layer_count(self.params["layers"])
        object.__setattr__(self, "_num_layers", n)
        fns = _layer_fns(self.layer, n, self.stacked)
        object.__setattr__(self, "_fns", fns)
        if len(set(map(id, fns))) == 1 and not self.stacked:
            _check_same_layers(self.params["layers"])
        if self.logical_names is not None:
            _check_names(self.logical_names, self.params)

    # ---------------------------------------------------------------- structure
    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def stacked(self) -> bool:
        """Whether ``params["layers"]`` is one stacked tree (else a list of per-layer trees)."""
        return not isinstance(self.params["layers"], (list, tuple))

    def layer_fn(self, i: int) -> LayerFn:
        return self._fns[i]

    @property
    def uniform(self) -> bool:
        """Whether every layer runs the same function."""
        return len(set(map(id, self._fns))) == 1

    def with_params(self, params: Mapping[str, Any]) -> "LayeredModel":
        """The same model with other parameters of the same structure (e.g. a checkpoint's)."""
        return dataclasses.replace(self, params=params)

    def abstract(self) -> "LayeredModel":
        """The model with ShapeDtypeStruct parameters (for planning: nothing allocated)."""
        return self.with_params(jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), self.params))

    # ---------------------------------------------------------------- running it
    def run_layers(self, layers: Any, x: Any, start: int, stop: int) -> Any:
        """Layers ``start .. stop-1`` on ``x``; ``layers``: their parameters (``slice_layers`` of them), each
        layer under the named scope ``layers_<i>`` (the CFP analysis finds the repeated layers by it)."""
        for i in range(start, stop):
            with jax.named_scope(f"layers_{i}"):
                x = self._fns[i](layer_at(layers, i - start, self.stacked), x)
        return x

    def forward(self, params: Mapping[str, Any], batch: Any) -> tuple[Any, Any]:
        """``(loss_sum, weight)`` of ``batch`` on one device, every layer in turn."""
        with jax.named_scope("first"):
            x = self.first(params["first"], batch)
        x = self.run_layers(params["layers"], x, 0, self.num_layers)
        with jax.named_scope("last"):
            return self.last(params["last"], x, batch)

    def loss(self, params: Mapping[str, Any], batch: Any) -> Any:
        """The batch's loss on one device: ``loss_sum / weight``."""
        loss_sum, weight = self.forward(params, batch)
        return loss_sum / weight

    # ---------------------------------------------------------------- checking it
    def check(self, batch: Any) -> Any:
        """Trace ``first``, every kind of layer and ``last`` on ``batch`` (abstractly: nothing runs) and raise a
        one-line ConfigError naming what breaks the contract; returns the activation's ShapeDtypeStruct tree."""
        _check_batch(batch)
        p = self.params
        x = _trace("first(params['first'], batch)", self.first, p["first"], batch)
        seen: set[int] = set()
        for i, fn in enumerate(self._fns):
            if id(fn) in seen and self.stacked:
                continue
            seen.add(id(fn))
            y = _trace(f"layer {i}", fn, layer_at(p["layers"], i, self.stacked), x)
            _same_activation(i, x, y)
        out = _trace("last(params['last'], x, batch)", self.last, p["last"], x, batch)
        _check_last(out)
        return x


# -------------------------------------------------------------------- layers: lists and stacks alike
def _index(a: Any, i: Any) -> Any:
    """``a[i]`` of an array, or the ShapeDtypeStruct it would have (abstract parameters)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        rows = len(range(a.shape[0])[i]) if isinstance(i, slice) else None
        return jax.ShapeDtypeStruct(((rows,) if rows is not None else ()) + tuple(a.shape[1:]), a.dtype)
    return a[i]


def layer_at(layers: Any, i: int, stacked: bool) -> Any:
    """Layer ``i``'s parameters of a list (``layers[i]``) or a stacked tree (every leaf's ``[i]``)."""
    return jax.tree_util.tree_map(lambda a: _index(a, i), layers) if stacked else layers[i]


def slice_layers(layers: Any, start: int, stop: int, stacked: bool) -> Any:
    """Layers ``start .. stop-1`` in the same form (a shorter list, or a stack of ``stop - start``)."""
    if stacked:
        return jax.tree_util.tree_map(lambda a: _index(a, slice(start, stop)), layers)
    return list(layers[start:stop])


def concat_layers(pieces: Sequence[Any], stacked: bool) -> Any:
    """Consecutive layer slices joined into one (inverse of ``slice_layers``)."""
    if not stacked:
        return [layer for piece in pieces for layer in piece]
    if len(pieces) == 1:
        return pieces[0]
    return jax.tree_util.tree_map(lambda *a: jnp.concatenate(a, axis=0), *pieces)


def stage_params(params: Mapping[str, Any], start: int, stop: int, first: bool, last: bool,
                 stacked: bool) -> dict:
    """The parameters (or any tree shaped like them: gradients) a stage holds: ``first`` when it is the first
    stage, layers ``start .. stop-1`` (no ``layers`` when it holds none: a virtual stage may), ``last`` when it is
    the last."""
    out = {"layers": slice_layers(params["layers"], start, stop, stacked)} if stop > start else {}
    if first:
        out["first"] = params["first"]
    if last:
        out["last"] = params["last"]
    return out


def merge_stage_params(parts: Sequence[Mapping[str, Any]], stacked: bool) -> dict:
    """The full tree from one pipeline's stage trees, in stage order (inverse of ``stage_params``)."""
    return {"first": parts[0]["first"], "layers": concat_layers([p["layers"] for p in parts if "layers" in p],
                                                                stacked),
            "last": parts[-1]["last"]}


# -------------------------------------------------------------------- validation helpers
def _layer_count(layers: Any) -> int:
    if isinstance(layers, (list, tuple)):
        if not layers:
            raise ConfigError("LayeredModel.params['layers'] is an empty list; a model needs at least one layer")
        return len(layers)
    leaves = jax.tree_util.tree_leaves(layers)
    if not leaves:
        raise ConfigError("LayeredModel.params['layers'] has no arrays: give a list of per-layer trees or one "
                          "tree stacked on a leading layer dim")
    dims = {(np.shape(a)[0] if np.ndim(a) else None) for a in leaves}
    if len(dims) != 1 or None in dims:
        paths = [(jax.tree_util.keystr(p), np.shape(a)) for p, a in
                 jax.tree_util.tree_flatten_with_path(layers)[0]]
        raise ConfigError(f"stacked LayeredModel.params['layers'] leaves disagree on the leading layer dim: "
                          f"{_short(paths)}; every leaf needs the same first dim (the layer count)")
    n = dims.pop()
    if n < 1:
        raise ConfigError("stacked LayeredModel.params['layers'] has 0 layers; a model needs at least one")
    return int(n)


def _layer_fns(layer: Any, n: int, stacked: bool) -> tuple:
    if callable(layer):
        return (layer,) * n
    if isinstance(layer, (list, tuple)) and all(callable(f) for f in layer):
        if len(layer) != n:
            raise ConfigError(f"LayeredModel.layer has {len(layer)} functions for {n} layers; give one "
                              "function, or one per layer")
        if stacked and len(set(map(id, layer))) > 1:
            raise ConfigError("LayeredModel.layer gives layers different functions but params['layers'] is "
                              "stacked (one structure for all); give a list of per-layer trees")
        return tuple(layer)
    raise ConfigError(f"LayeredModel.layer={layer!r} must be a callable (one repeated layer) or a sequence of "
                      "callables (one per layer)")


def _signature(tree: Any) -> tuple:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return tuple((jax.tree_util.keystr(p), tuple(np.shape(a)), str(jnp.result_type(a))) for p, a in leaves)


def _check_same_layers(layers: Sequence[Any]) -> None:
    """One layer function for all: every layer's parameters must have layer 0's structure, shapes, dtypes."""
    ref_tree = jax.tree_util.tree_structure(layers[0])
    ref = _signature(layers[0])
    for i, tree in enumerate(layers[1:], start=1):
        if jax.tree_util.tree_structure(tree) != ref_tree:
            raise ConfigError(f"layer {i}'s parameters have another structure than layer 0's "
                              f"({_short([k for k, _, _ in _signature(tree)])} vs "
                              f"{_short([k for k, _, _ in ref])}); one layer function needs one structure")
        for (k, s, d), (_, s0, d0) in zip(_signature(tree), ref):
            if (s, d) != (s0, d0):
                raise ConfigError(f"layer {i}'s parameter {k} is {d}{list(s)} but layer 0's is {d0}{list(s0)}; "
                                  "one layer function needs the same shapes in every layer")


def _check_names(names: Any, params: Mapping[str, Any]) -> None:
    is_names = lambda t: isinstance(t, tuple) and all(n is None or isinstance(n, str) for n in t)
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    named = jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda t: t is None or is_names(t))[0]
    table = {jax.tree_util.keystr(p): t for p, t in named}
    for path, a in leaves:
        t = table.get(jax.tree_util.keystr(path))
        if t is not None and (not is_names(t) or len(t) != np.ndim(a)):
            raise ConfigError(f"logical_names{jax.tree_util.keystr(path)}={t!r} must be a tuple of "
                              f"{np.ndim(a)} dim names (str or None) for the parameter of shape {np.shape(a)}")


def _check_batch(batch: Any) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ConfigError("the example batch has no arrays")
    rows = {jax.tree_util.keystr(p): (np.shape(a)[0] if np.ndim(a) else None) for p, a in leaves}
    if None in rows.values() or len(set(rows.values())) != 1:
        raise ConfigError(f"batch leaves must share a leading batch dim, got {_short(rows)}")


def _trace(what: str, fn: Callable, *args: Any) -> Any:
    try:
        return jax.eval_shape(fn, *args)
    except ConfigError:
        raise
    except Exception as e:  # the user's code: say where it failed, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{what} failed: {type(e).__name__}: {first[:300]}") from e


def _describe(tree: Any) -> str:
    return _short([f"{jax.tree_util.keystr(p) or 'x'}:{a.dtype}{list(a.shape)}"
                   for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]])


def _same_activation(i: int, x: Any, y: Any) -> None:
    if jax.tree_util.tree_structure(x) != jax.tree_util.tree_structure(y) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in
            zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y))):
        raise ConfigError(f"layer {i} changes the activation from {_describe(x)} to {_describe(y)}; a layer "
                          "must return the same structure, shapes and dtypes it takes")


def _check_last(out: Any) -> None:
    ok = isinstance(out, (tuple, list)) and len(out) == 2 and all(
        isinstance(a, jax.ShapeDtypeStruct) and a.shape == () for a in out)
    if not ok:
        got = _describe(out) if jax.tree_util.tree_leaves(out) else repr(out)
        raise ConfigError(f"last(params['last'], x, batch) returned {got}; it must return (loss_sum, weight), "
                          "two scalars")


def _short(v: Any, limit: int = 160) -> str:
    text = repr(v) if not isinstance(v, str) else v
    return text if len(text) <= limit else text[:limit - 3] + "..."


def param_count(tree: Any) -> int:
    """Number of parameter elements in ``tree``."""
    return int(sum(math.prod(np.shape(a)) for a in jax.tree_util.tree_leaves(tree)))
