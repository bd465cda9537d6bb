"""Single-device replay of a training run and the comparison behind ``cfp train --verify``.

A reference is a loss ``loss(params, batch)`` and an optax transformation, run as one ``value_and_grad`` on the
whole global batch and one update, jitted on one device, from the same state. For a user's model they are its own:
`LayeredModel.loss` (its ``first``, layers and ``last`` composed on one device) and the user's optimizer
(`model_reference`). For the zoo they are built independently of the code they check (`zoo_reference`): the loss
from the model directly (``build_model(...).apply``, optax's integer-label cross-entropy weighted by the batch's
weights, plus ``aux_loss_coef`` times the MoE aux loss) and AdamW from optax directly with the documented
hyper-parameters of ``TrainOptions``, never the zoo's `LayeredModel` or ``cfp.runtime.engine.adamw``: a bug
there (say, weight decay dropped) must not reach the reference too.

Relative error: for losses ``|a - b| / |b|``; for parameters the normwise ``||a - b||_2 / ||b||_2`` over all
parameters (``tree_error``), or per leaf (``leaf_errors``). Elementwise comparison of parameters after Adam steps
is not meaningful in f32: Adam divides each gradient by its running RMS, so an element whose gradient is a
near-cancelling sum (rounding noise a sizeable fraction of its value) moves by a visibly different amount when
the reduction order changes (micro-batching, TP all-reduces, summing pipelines) although the gradient as a whole
matches to ~1e-7. Per leaf this even holds for whole leaves whose exact gradient is zero, e.g. attention key
biases (softmax ignores a per-row constant): both runs move them by +-lr per step driven by rounding noise
alone, so the verify figure is the global normwise error. For a comparison free of micro-batching's reordering
noise, ``microbatched_replay`` accumulates the same micro-batches in the same order as the engine.
``sequence_replay`` is the reference of variable-length steps (``cfp data train --verify``): each sequence alone
in its row, so packing, dispatch, pipelines and CP are all outside it.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cfp.errors import ConfigError, NumericalError
from cfp.models import build_model

Reference = tuple[Callable[[Any, Any], Any], optax.GradientTransformation]


def reference_optimizer(learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
    """AdamW as ``TrainOptions`` documents it (optax's default betas and eps), built from optax here."""
    return optax.adamw(learning_rate, weight_decay=weight_decay)


def reference_loss(model_name: str, config: Any):
    """``loss(params, batch)`` on the zoo model's ``{"params": ...}`` tree: the weighted mean token cross-entropy of
    the model's logits (+ coef * aux), written out from the model's ``apply`` rather than taken from
    ``cfp.models.loss_fn`` or the zoo's `LayeredModel`."""
    model = build_model(model_name, config)
    coef = float(getattr(config, "aux_loss_coef", 0.0))

    def loss(params, batch):
        logits, aux = model.apply(params, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
        w = batch["weights"].astype(jnp.float32)
        return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-9) + coef * aux.astype(jnp.float32)
    return loss


def zoo_reference(model_name: str, config: Any, learning_rate: float, weight_decay: float) -> Reference:
    """The zoo run's reference on its layered parameters (``{"first", "layers", "last"}``): `reference_loss` on the
    same values regrouped as the zoo model's tree, and `reference_optimizer`."""
    from cfp.models.layered import zoo_full_params
    loss = reference_loss(model_name, config)
    return (lambda p, batch: loss(zoo_full_params(p), batch)), reference_optimizer(learning_rate, weight_decay)


def model_reference(model: Any, optimizer: optax.GradientTransformation) -> Reference:
    """A user's model's reference: its own loss on one device (`LayeredModel.loss`) and its own optimizer."""
    return model.loss, optimizer


def reference_step(loss: Callable, tx: optax.GradientTransformation) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` of a reference (not jitted)."""
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return step


def replay(loss: Callable, tx: optax.GradientTransformation, params: Any, opt_state: Any,
           batches: Iterable[Any], device: Optional[Any] = None):
    """Run the reference steps on one device; returns (losses, final params as numpy)."""
    device = device if device is not None else jax.local_devices()[0]
    step = jax.jit(reference_step(loss, tx))
    p, o = jax.device_put((params, opt_state), device)
    losses = []
    for b in batches:
        p, o, value = step(p, o, jax.device_put(b, device))
        losses.append(float(value))
    return losses, jax.tree_util.tree_map(np.asarray, jax.device_get(p))


def default_tolerance(model: Any, batch: Any) -> float:
    """The ``--verify`` bound when none is given: 1e-4 when the parameters and the activation are float32 (measured
    reordering noise after a few steps is below 1e-5), 5e-2 when any is of lower precision (bfloat16 rounding)."""
    x = model.check(batch)
    leaves = jax.tree_util.tree_leaves(model.abstract().params) + jax.tree_util.tree_leaves(x)
    low = any(jnp.issubdtype(l.dtype, jnp.floating) and jnp.finfo(l.dtype).bits < 32 for l in leaves)
    return 5e-2 if low else 1e-4


def _sequence_rows(seqs: list, tokens: int = 8192) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each sequence alone in a row from position 0, padded at the end (weight 0); rows of one power-of-two
    width go in chunks of ``tokens // width`` rows (padding rows have weight 0), so each width compiles once."""
    groups: dict[int, list] = {}
    for s in seqs:
        groups.setdefault(max(16, 1 << int(np.ceil(np.log2(s.size - 1)))), []).append(s)
    out = []
    for width, group in sorted(groups.items()):
        rows = max(1, tokens // width)
        for at in range(0, len(group), rows):
            x, y, w = (np.zeros((rows, width), dt) for dt in (np.int32, np.int32, np.float32))
            for r, s in enumerate(group[at:at + rows]):
                n = s.size - 1
                x[r, :n], y[r, :n], w[r, :n] = s[:-1], s[1:], 1.0
            out.append((x, y, w))
    return out


def sequence_replay(model_name: str, config: Any, params: Any, opt_state: Any, steps: Iterable[list], *,
                    learning_rate: float, weight_decay: float, device: Optional[Any] = None):
    """Reference of variable-length training: per step, every sequence (token array, inputs ``s[:-1]``,
    targets ``s[1:]``) runs alone through the model (no packing, no pipelines, no CP/TP); the loss is the
    cross-entropy summed over all real tokens divided by their count, the update AdamW
    (``reference_optimizer``). ``params``/``opt_state``: the zoo's `LayeredModel` state. Returns (losses, final
    params as numpy, in the same structure). Dense models (no aux loss)."""
    from cfp.models.layered import zoo_full_params, zoo_params
    device = device if device is not None else jax.local_devices()[0]
    model = build_model(model_name, config)
    params, opt_state = _as_zoo(params, opt_state, zoo_full_params)

    def loss_sum(p, x, y, w):
        logits, _ = model.apply(p, x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return jnp.sum(ce * w)

    grad = jax.jit(jax.value_and_grad(loss_sum))
    tx = reference_optimizer(learning_rate, weight_decay)
    update = jax.jit(lambda p, o, g, inv: _apply(tx, p, o, jax.tree_util.tree_map(lambda a: a * inv, g)))
    p, o = jax.device_put((params, opt_state), device)
    losses = []
    for seqs in steps:
        total, grads = 0.0, None
        for rows in _sequence_rows(list(seqs)):
            v, g = grad(p, *jax.device_put(rows, device))
            total += float(v)
            grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        tokens = sum(int(s.size) - 1 for s in seqs)
        p, o = update(p, o, grads, jnp.float32(1.0 / tokens))
        losses.append(total / tokens)
    return losses, zoo_params(jax.tree_util.tree_map(np.asarray, jax.device_get(p)), config.num_layers)


def loss_error(losses: list[float], ref: list[float]) -> float:
    """Largest relative loss error ``|a - b| / |b|``; NaN/Inf in either list raises NumericalError."""
    if len(losses) != len(ref):
        raise ConfigError(f"{len(losses)} losses to compare with {len(ref)} reference losses")
    for name, vals in (("loss", losses), ("reference loss", ref)):
        for i, v in enumerate(vals):
            if not np.isfinite(v):
                raise NumericalError(f"{name} {i + 1} of {len(vals)} compared is {v}")
    return max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref)), default=0.0)


def _leaf_pairs(tree: Any, ref: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(path, a, b) per leaf, after checking both trees have the same structure and shapes and
    hold only finite values (NumericalError naming the leaf otherwise)."""
    if jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(ref):
        raise ConfigError(f"trees to compare differ in structure: {jax.tree_util.tree_structure(tree)} "
                          f"vs {jax.tree_util.tree_structure(ref)}")
    out = []
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(tree)[0],
                            jax.tree_util.tree_leaves(ref)):
        name = jax.tree_util.keystr(path)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ConfigError(f"leaf {name} has shape {a.shape}, the reference {b.shape}")
        for what, v in (("value", a), ("reference value", b)):
            if not np.isfinite(v).all():
                raise NumericalError(f"leaf {name}: {what} contains NaN or Inf")
        out.append((name, a, b))
    return out


def tree_error(tree: Any, ref: Any) -> float:
    """Normwise relative error ``||a - b|| / ||b||`` over all leaves together."""
    pairs = _leaf_pairs(tree, ref)
    diff = sum(float(np.sum((a - b) ** 2)) for _, a, b in pairs)
    norm = sum(float(np.sum(b ** 2)) for _, _, b in pairs)
    return float(np.sqrt(diff) / max(np.sqrt(norm), 1e-30))


def leaf_errors(tree: Any, ref: Any, floor: float = 0.0) -> dict[str, float]:
    """Per leaf, ``||a - b|| / max(||b||, floor)`` (``floor`` keeps a leaf whose exact value is ~0,
    hence pure rounding noise, from dividing noise by noise)."""
    return {name: float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), floor, 1e-30))
            for name, a, b in _leaf_pairs(tree, ref)}


def identical_across_pipelines(trainer) -> bool:
    """Whether every pipeline holds bit-identical values of every parameter (single process: all stages local)."""
    from cfp.layered.model import merge_stage_params
    full = []
    for p in range(len(trainer.layout.pipelines)):
        parts = [jax.tree_util.tree_map(np.asarray, trainer.params[st.key]) for st in trainer.layout.placed_in(p)]
        full.append(jax.tree_util.tree_leaves(merge_stage_params(parts, trainer.model.stacked)))
    return all(len(f) == len(full[0]) and all(np.array_equal(a, b) for a, b in zip(f, full[0])) for f in full[1:])


def _as_zoo(params: Any, opt_state: Any, convert: Callable) -> tuple[Any, Any]:
    """A zoo `LayeredModel`'s parameters and AdamW state regrouped as the zoo model's ``{"params": ...}`` tree."""
    return convert(params), jax.tree_util.tree_map(
        lambda t: convert(t) if isinstance(t, dict) and set(t) == {"first", "layers", "last"} else t, opt_state,
        is_leaf=lambda t: isinstance(t, dict) and set(t) == {"first", "layers", "last"})


def microbatched_replay(model_name: str, config: Any, layout: Any, params: Any, opt_state: Any,
                        batches: Iterable[dict], *, learning_rate: float, weight_decay: float,
                        device: Optional[Any] = None):
    """The engine's arithmetic on one device: (losses, final params as numpy, per-step gradients), for the zoo's
    `LayeredModel` state (``params``, ``opt_state``; results in the same structure).

    Each pipeline accumulates its micro-batches' gradients in micro-batch order, starting from zeros; the
    pipelines' sums are then added in pipeline order, and AdamW is applied -- the same float32 sums in the same
    order as ``HeteroTrainer.step``. Only the programs differ (one whole-model ``value_and_grad`` here, per-stage
    ``vjp`` with TP all-reduces there), so the comparison with the engine isolates pipeline and TP errors from
    the reordering noise of micro-batching.
    """
    from cfp.models.layered import zoo_full_params, zoo_params
    device = device if device is not None else jax.local_devices()[0]
    model = build_model(model_name, config)
    coef = float(getattr(config, "aux_loss_coef", 0.0))
    params, opt_state = _as_zoo(params, opt_state, zoo_full_params)

    def part(p, x, t, w, aux_weight):
        logits, aux = model.apply(p, x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), t)
        loss_sum = jnp.sum(ce * w.astype(jnp.float32)) + aux.astype(jnp.float32) * aux_weight
        return loss_sum, loss_sum

    grad = jax.jit(jax.grad(part, has_aux=True))
    add = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))
    tx = reference_optimizer(learning_rate, weight_decay)
    update = jax.jit(lambda p, o, g, inv_w: _apply(tx, p, o, jax.tree_util.tree_map(lambda a: a * inv_w, g)))
    p, o = jax.device_put((params, opt_state), device)
    losses, grads_per_step = [], []
    for b in batches:
        b = jax.tree_util.tree_map(np.asarray, b)
        total, loss_sum, weight = None, 0.0, 0.0
        for pipe, off in zip(layout.pipelines, layout.batch_offsets()):
            mbs = pipe.micro_batch
            acc = jax.tree_util.tree_map(jnp.zeros_like, p)
            for m in range(pipe.chunks):
                sl = slice(off + m * mbs, off + (m + 1) * mbs)
                w_mb = np.float32(b["weights"][sl].astype(np.float32).sum())
                # the engine's `last`: sum(ce * w) + coef * aux * sum(w) per micro-batch, its gradient summed
                g, v = grad(p, *jax.device_put((b["inputs"][sl], b["targets"][sl], b["weights"][sl]), device),
                            np.float32(coef) * w_mb)
                acc = add(acc, g)
                loss_sum, weight = loss_sum + float(v), weight + float(w_mb)
            total = acc if total is None else add(total, acc)
        inv_w = np.float32(1.0) / np.float32(weight)
        grads_per_step.append(zoo_params(jax.tree_util.tree_map(lambda a: np.asarray(a) * inv_w,
                                                                jax.device_get(total)), config.num_layers))
        p, o = update(p, o, total, inv_w)
        losses.append(loss_sum / weight)
    return losses, zoo_params(jax.tree_util.tree_map(np.asarray, jax.device_get(p)), config.num_layers), \
        grads_per_step


def _apply(tx, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
