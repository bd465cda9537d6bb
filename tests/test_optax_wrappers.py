"""The optax wrappers users put around their optimizer, trained through the runtime's optimizer partition
(`cfp.runtime.stage.optim` on `cfp.runtime.optimizer`), against the same optimizer on one device.

The wrappers are those that change control flow or reduce across parameters: ``apply_if_finite``,
``MultiSteps`` (with and without ``skip_not_finite``), ``masked``, ``clip_by_global_norm`` inside ``chain``,
``inject_hyperparams``, ``zero_nans``. Each trains a user's `LayeredModel` on two pipelines of other stage boundaries
(TP 2 + TP 1, and TP 1), and step 3 of every run has a gradient that is not finite while its loss is finite
(0 * inf in the backward of one row through layer 3: NaN in that layer's rows of one stacked leaf, on pipeline 0's
second stage, while the first stage's gradients are finite).
A wrapper that rejects such a gradient must train on like one device; for the others cfp must stop at that step
with `NumericalError` (the one-device run's parameters are NaN there).

Like with like: the reference (`microbatched`) feeds the same micro-batches in the same order, accumulating each
pipeline's gradients of the summed loss in micro-batch order, summing the pipelines in order and scaling by
1 / the total weight, as the engine does; only the programs differ (one whole-model ``grad`` there, per-stage
``vjp``, TP all-reduces and the partition's per-unit updates here).

Tolerance from measured noise: the reference runs in float32 and in float64, and cfp's float32 parameters must be
within ``NOISE_FACTOR`` times the float32 reference's own normwise distance from the float64 one, floored at
``FLOOR`` (measured over these cases and steps: the float32 reference's distance up to 5.8e-7, cfp's up to 5.7e-7,
at most 1.0x the reference's; the optimizer state likewise). The check can fail: every case asserts that the
steps moved the parameters by more than 100x its tolerance, and a wrapper's reduction combined the wrong way
across stages (mutant ``optax-wrapper-finite-any-stage``) fails it, as does stopping the run on a gradient the
optimizer rejected (``engine-raises-on-rejected-gradient``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cfp.errors import NumericalError
from cfp.layered.model import LayeredModel
from cfp.layout import Layout

L, D, V, S = 5, 16, 32, 4
# two pipelines of other boundaries: TP 2 + TP 1 (3 + 2 layers, 3 micro-batches of 2 rows), TP 1 (5 layers, 2)
LAYOUT = ([[2, 1], [1]], [[3, 2], [5]], [6, 4], [3, 2])
STEPS, BAD_STEP = 5, 3             # step 3 (1-based) has a non-finite gradient
POISONED = 3                       # in layer 3's rows only
NOISE_FACTOR, FLOOR = 8.0, 1e-6


@functools.cache
def model(stacked: bool = True) -> LayeredModel:
    """Embedding, L residual tanh-MLP layers (hidden dim named "mlp": TP splits it), a head. The activation is
    ``(h, z, k)``: ``k`` counts the layers run, ``z`` is the batch's per-row poison (-1: none); each layer adds
    ``0.01 * sqrt((z - k)^2 * (1 + g^2))`` to ``h``, finite always, but whose gradient in the layer's scalar
    ``g`` is 0 * inf = NaN in the layer ``k == z``: a non-finite gradient in one layer's rows only."""
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    layers = {"w1": jax.random.normal(k[0], (L, D, 2 * D)) / np.sqrt(D), "b1": jnp.zeros((L, 2 * D)),
              "w2": jax.random.normal(k[1], (L, 2 * D, D)) / np.sqrt(2 * D), "g": jax.random.normal(k[4], (L,))}
    names = {"w1": (None, "embed", "mlp"), "b1": (None, "mlp"), "w2": (None, "mlp", "embed"), "g": (None,)}
    if not stacked:
        layers = [jax.tree_util.tree_map(lambda a: a[i], layers) for i in range(L)]
        names = [{n: t[1:] for n, t in names.items()}] * L
    params = {"first": {"table": jax.random.normal(k[2], (V, D))}, "layers": layers,
              "last": {"out": jax.random.normal(k[3], (D, V)) / np.sqrt(D)}}

    def first(p, batch):
        return p["table"][batch["x"]], batch["z"], jnp.zeros_like(batch["z"])

    def layer(p, x):
        h, z, n = x
        poison = 0.01 * jnp.sqrt((z - n) ** 2 * (1.0 + p["g"] ** 2))
        return h + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"] + poison[:, None, None], z, n + 1.0

    def last(p, x, batch):
        ce = optax.softmax_cross_entropy_with_integer_labels(x[0] @ p["out"], batch["y"])
        return jnp.sum(ce * batch["w"]), jnp.sum(batch["w"])
    return LayeredModel(first=first, layer=layer, last=last, params=params,
                        logical_names={"first": {"table": ("vocab", "embed")}, "layers": names,
                                       "last": {"out": ("embed", "vocab")}}, name="wrapped-lm")


def micro_batches(step: int) -> list[list[dict]]:
    """Step ``step``'s (1-based) micro-batches per pipeline; on `BAD_STEP` one row of pipeline 1's last
    micro-batch poisons layer `POISONED` (on pipeline 0's second stage)."""
    rng = np.random.default_rng(step)
    lay = Layout.from_lists(*LAYOUT)
    out = []
    for p, pipe in enumerate(lay.pipelines):
        mbs = []
        for m in range(pipe.chunks):
            n = pipe.micro_batch
            mb = {"x": rng.integers(0, V, (n, S)).astype(np.int32), "y": rng.integers(0, V, (n, S)).astype(np.int32),
                  "w": (rng.random((n, S)) < 0.8).astype(np.float32), "z": np.full((n,), -1.0, np.float32)}
            if step == BAD_STEP and p == 1 and m == pipe.chunks - 1:
                mb["z"][1] = POISONED
            mbs.append(mb)
        out.append(mbs)
    return out


@functools.cache
def _grad(m: LayeredModel):
    """``(params, micro-batch) -> (gradient of loss_sum, (loss_sum, weight))`` on one device, jitted once."""
    return jax.jit(jax.grad(lambda p, b: (m.forward(p, b)[0], m.forward(p, b)), has_aux=True))


_add = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))


def microbatched(m: LayeredModel, tx, steps, dtype):
    """The engine's arithmetic on one device in ``dtype``: per step (params, opt_state, loss, the gradient's
    non-finite entries by leaf), up to the first step whose parameters are not finite."""
    cast = lambda t: jax.tree_util.tree_map(
        lambda a: jnp.asarray(a, dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else jnp.asarray(a), t)
    grad, add = _grad(m), _add

    @jax.jit
    def update(p, o, g, inv):
        u, o = tx.update(jax.tree_util.tree_map(lambda a: a * inv, g), o, p)
        return optax.apply_updates(p, u), o

    params = cast(m.params)
    state = tx.init(params)
    out = []
    for step in steps:
        total, loss_sum, weight = None, 0.0, 0.0
        for mbs in micro_batches(step):
            acc = jax.tree_util.tree_map(jnp.zeros_like, params)
            for mb in mbs:
                g, (value, w) = grad(params, cast(mb))
                acc = add(acc, g)
                loss_sum, weight = loss_sum + float(value), weight + float(w)
            total = acc if total is None else add(total, acc)
        bad = {jax.tree_util.keystr(path): np.argwhere(~np.isfinite(np.asarray(a))).tolist()
               for path, a in jax.tree_util.tree_flatten_with_path(total)[0] if not np.isfinite(np.asarray(a)).all()}
        params, state = update(params, state, total, jnp.asarray(1.0, dtype) / jnp.asarray(weight, dtype))
        out.append((jax.device_get(params), jax.device_get(state), loss_sum / weight, bad))
        if not all(bool(np.isfinite(np.asarray(a)).all()) for a in jax.tree_util.tree_leaves(params)):
            break
    return out


def distance(a, b) -> float:
    """Normwise relative distance ||a - b|| / ||b|| over every leaf, in float64."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
    return (num / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)) ** 0.5


def finite(tree) -> bool:
    return all(bool(np.isfinite(np.asarray(a)).all()) for a in jax.tree_util.tree_leaves(tree)
               if jnp.issubdtype(np.asarray(a).dtype, jnp.floating))


SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)
# name -> (transformation, whether it rejects a non-finite gradient)
WRAPPERS = {
    "apply_if_finite(clip+adam)": (lambda: optax.apply_if_finite(
        optax.chain(optax.clip_by_global_norm(0.3), optax.adam(1e-2)), max_consecutive_errors=2), True),
    "MultiSteps(adamw,skip_not_finite)": (lambda: optax.MultiSteps(
        optax.adamw(1e-2, weight_decay=0.1), every_k_schedule=2, should_skip_update_fn=optax.skip_not_finite), True),
    "zero_nans+adam": (lambda: optax.chain(optax.zero_nans(), optax.adam(1e-2)), True),
    "MultiSteps(clip+adam)": (lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.3), optax.adam(1e-2)), every_k_schedule=2), False),
    "masked(decay)+adam": (lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(0.1), lambda p: jax.tree_util.tree_map(lambda a: a.ndim > 1, p)),
        optax.adam(1e-2)), False),
    "adam>clip>schedule": (lambda: optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(20.0),
                                               optax.scale_by_learning_rate(SCHEDULE)), False),
    "inject_hyperparams(adamw)": (lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=SCHEDULE, b1=0.8, weight_decay=0.1), False),
}


def _tol(mine, r32, r64) -> tuple[float, float]:
    """(cfp's distance from float64, its bound: NOISE_FACTOR x the float32 reference's, floored)."""
    return distance(mine, r64), max(NOISE_FACTOR * distance(r32, r64), FLOOR)


def _exact_leaves(tree) -> list:
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(tree) if not jnp.issubdtype(np.asarray(a).dtype,
                                                                                          jnp.floating)]


SLOW = {"zero_nans+adam", "MultiSteps(clip+adam)"}      # the fast tier keeps one of each kind


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in WRAPPERS])
def test_wrapper_trains_like_one_device(name):
    """Every step matches one device (parameters, float state normwise, integer and boolean state exactly, the
    loss); at the first step whose one-device parameters are not finite cfp raises `NumericalError` naming it."""
    from cfp.runtime.engine import HeteroTrainer
    from references import identical_across_pipelines
    make, rejects = WRAPPERS[name]
    tx, m = make(), model()
    steps = range(1, STEPS + 1)
    ref32 = microbatched(m, tx, steps, jnp.float32)
    with jax.enable_x64(True):
        ref64 = microbatched(m, tx, steps, jnp.float64)
    # the premise: a non-finite gradient in layer 3's row of one stacked leaf, that step only
    assert [r[3] for r in ref32] == [r[3] for r in ref64] == [
        {"['layers']['g']": [[POISONED]]} if s == BAD_STEP else {} for s in steps][:len(ref32)]
    assert (len(ref32) == STEPS and finite(ref32[-1][0])) == rejects     # and whether the wrapper rejects it
    trainer = HeteroTrainer(m, tx, Layout.from_lists(*LAYOUT), "1f1b", example_batch=micro_batches(1)[0][0]).init()
    for step, (p32, s32, _, _), (p64, s64, loss64, _) in zip(steps, ref32, ref64):
        if not finite(p32):
            with pytest.raises(NumericalError, match=f"^step {step}: "):
                trainer.step(micro_batches(step))
            return
        loss = trainer.step(micro_batches(step)).loss
        params, state, _ = trainer.state()
        err, tol = _tol(params, p32, p64)
        print(f"{name} step {step}: params {err:.2g} (float32 reference {distance(p32, p64):.2g}), tol {tol:.2g}")
        assert err <= tol, f"step {step}: parameters {err:.3g} from one device, tolerance {tol:.3g}"
        assert distance(p64, m.params) > 100 * tol or step == 1 and "MultiSteps" in name
        floats = lambda t: [a for a in jax.tree_util.tree_leaves(t) if jnp.issubdtype(np.asarray(a).dtype,
                                                                                      jnp.floating)]
        err, tol = _tol(floats(state), floats(s32), floats(s64))
        assert err <= tol, f"step {step}: optimizer state {err:.3g} from one device, tolerance {tol:.3g}"
        mine, want = _exact_leaves(state), _exact_leaves(s64)
        assert len(mine) == len(want) and all(np.array_equal(a, b) for a, b in zip(mine, want)), (mine, want)
        assert abs(loss - loss64) <= max(NOISE_FACTOR * abs(ref32[step - 1][2] - loss64), FLOOR) * abs(loss64)
    assert identical_across_pipelines(trainer)
