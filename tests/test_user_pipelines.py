"""A user's own model on the heterogeneous pipeline runtime: any `LayeredModel` (list or stacked layers) with any
optax optimizer trains like one device, unequal stages with TP 1-2 and two pipelines; the refused
transformation; stop and resume onto another layout; bad input as one-line errors."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cfp.errors import ConfigError
from cfp.layered.model import LayeredModel
from cfp.layout import Layout

L, D, V, S, ROWS = 5, 32, 64, 8, 12
# Two pipelines of unequal stages: TP 2 + TP 1 (3 + 2 layers, micro-batches of 2) and TP 1 x 3 (1 + 1 + 3 layers)
LAYOUT = ([[2, 1], [1, 1, 1]], [[3, 2], [1, 1, 3]], [8, 4], [4, 2])
OTHER = ([[1, 1], [2]], [[4, 1], [5]], [6, 6], [3, 2])
# float32 reordering noise (micro-batches, TP all-reduces, pipeline sums) after 3 steps of each optimizer below,
# measured normwise on the parameters against the one-device reference: <= 5.0e-7 (clip + AdamW; <= 2.7e-8 for the
# others); two valid one-device summation orders differ by up to 1.4e-7; losses <= 4.9e-7 relative. The bounds
# are 20x that; a stage left out of the global norm, a skipped update or a pipeline's gradient dropped is >= 1e-4
# (the steps move the parameters by 6.6e-3 to 5.5e-2, checked below)
PARAM_TOL = 1e-5
LOSS_TOL = 1e-5


def _model(stacked: bool) -> LayeredModel:
    """Embedding, L residual tanh-MLP layers, head: plain JAX; the MLP's hidden dim named "mlp" (TP splits it)."""
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    layers = {"w1": jax.random.normal(k[0], (L, D, 2 * D)) / np.sqrt(D), "b1": jnp.zeros((L, 2 * D)),
              "w2": jax.random.normal(k[1], (L, 2 * D, D)) / np.sqrt(2 * D)}
    names = {"w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed")}
    if stacked:
        names = {n: (None,) + t for n, t in names.items()}
    else:
        layers = [jax.tree_util.tree_map(lambda a: a[i], layers) for i in range(L)]
        names = [names] * L
    params = {"first": {"table": jax.random.normal(k[2], (V, D))}, "layers": layers,
              "last": {"out": jax.random.normal(k[3], (D, V)) / np.sqrt(D)}}

    def layer(p, x):
        return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    def last(p, x, batch):
        ce = optax.softmax_cross_entropy_with_integer_labels(x @ p["out"], batch["y"])
        return jnp.sum(ce * batch["w"]), jnp.sum(batch["w"])
    return LayeredModel(first=lambda p, batch: p["table"][batch["x"]], layer=layer, last=last, params=params,
                        logical_names={"first": {"table": ("vocab", "embed")}, "layers": names,
                                       "last": {"out": ("embed", "vocab")}}, name="mlp-lm")


def _batches(steps: int = 3):
    rng = np.random.default_rng(1)
    return [{"x": rng.integers(0, V, (ROWS, S)).astype(np.int32), "y": rng.integers(0, V, (ROWS, S)).astype(np.int32),
             "w": (rng.random((ROWS, S)) < 0.8).astype(np.float32)} for _ in range(steps)]


def _reference(model, tx, batches):
    """One device: the model's own loss on the whole batch, the optimizer on the whole parameter tree."""
    from cfp.runtime.verify import replay
    p = jax.tree_util.tree_map(np.asarray, model.params)
    return replay(model.loss, tx, p, tx.init(p), batches)


def _rel(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
    return (num / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)) ** 0.5


OPTIMIZERS = {
    "adamw-schedule": lambda: optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20), weight_decay=0.1),
    # a bound the gradient's global norm exceeds (measured ~2.2 at step 1): the clip scales every update
    "clip-global-norm+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.3),
                                                  optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10))),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=16),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_user_model_trains_like_one_device_with_any_optimizer(name, stacked):
    from cfp.runtime.engine import HeteroTrainer
    from cfp.runtime.verify import identical_across_pipelines
    model, tx, batches = _model(stacked), OPTIMIZERS[name](), _batches()
    trainer = HeteroTrainer(model, tx, Layout.from_lists(*LAYOUT), "1f1b", example_batch=batches[0]).init()
    losses = [trainer.step(b).loss for b in batches]
    ref_losses, ref_params = _reference(model, tx, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_TOL)
    params = trainer.state()[0]
    assert _rel(params, ref_params) < PARAM_TOL
    assert _rel(model.params, ref_params) > 100 * PARAM_TOL        # the steps moved the parameters
    assert identical_across_pipelines(trainer)


def test_global_norm_is_taken_over_every_stage():
    """The clipped update differs from clipping each stage by its own norm: the check above would see it."""
    model, batches = _model(True), _batches(1)
    tx = OPTIMIZERS["clip-global-norm+adamw"]()
    grads = jax.grad(model.loss)(model.params, batches[0])
    norm = float(optax.global_norm(grads))
    per_stage = [float(optax.global_norm(jax.tree_util.tree_map(lambda a: a[lo:hi], grads["layers"])))
                 for lo, hi in ((0, 3), (3, 5))]
    assert norm > 0.3 and all(n < norm for n in per_stage)      # the clip is active and the stages' norms differ
    del tx


def test_a_transformation_mixing_parameters_is_refused_before_training():
    from cfp.runtime.engine import HeteroTrainer
    model, batches = _model(True), _batches(1)
    with pytest.raises(ConfigError) as e:
        HeteroTrainer(model, optax.flatten(optax.adam(1e-3)), Layout.from_lists(*LAYOUT), example_batch=batches[0])
    assert "\n" not in str(e.value)


def test_stop_and_resume_onto_another_layout(tmp_path):
    """A run stopped after step 2 and resumed onto another layout gives, bit for bit, the losses of an uninterrupted
    run that switched to that layout after step 2 (a checkpoint is the layout-independent state), and close to the
    run that never changed layout."""
    import cfp
    from cfp.runtime.engine import HeteroTrainer
    model, tx, batches = _model(True), OPTIMIZERS["clip-global-norm+adamw"](), _batches(4)
    rows = Layout.from_lists(*LAYOUT).global_batch
    data = lambda step, n: batches[step]
    kw = dict(steps=4, log=lambda *a, **k: None, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1)
    cfp.train_pipelines(model, tx, Layout.from_lists(*LAYOUT), data, stop_after=2, **kw)
    resumed = cfp.train_pipelines(model, tx, Layout.from_lists(*OTHER), data, resume=True, **kw)
    switched = HeteroTrainer(model, tx, Layout.from_lists(*LAYOUT), "1f1b", example_batch=batches[0]).init()
    losses = [switched.step(b).loss for b in batches[:2]]
    switched.set_layout(Layout.from_lists(*OTHER))
    losses += [switched.step(b).loss for b in batches[2:]]
    assert [resumed.losses[k] for k in range(1, 5)] == losses
    assert rows == Layout.from_lists(*OTHER).global_batch


def test_user_model_errors_are_one_line():
    from cfp.runtime.engine import HeteroTrainer
    model, batch = _model(True), _batches(1)[0]
    bad = [
        (dict(layer=lambda p, x: x[..., :-1]), "layer 0 changes the activation"),
        (dict(last=lambda p, x, b: jnp.sum(x)), "must return (loss_sum, weight)"),
    ]
    for change, message in bad:
        import dataclasses
        m = dataclasses.replace(model, **change)
        with pytest.raises(ConfigError) as e:
            m.check(batch)
        assert message in str(e.value) and "\n" not in str(e.value)
    layers = [jax.tree_util.tree_map(lambda a: a[i], model.params["layers"]) for i in range(L)]
    layers[2] = dict(layers[2], extra=jnp.zeros(3))
    with pytest.raises(ConfigError, match="layer 2's parameters have another structure"):
        LayeredModel(first=model.first, layer=model.layer, last=model.last,
                     params=dict(model.params, layers=layers))
    with pytest.raises(ConfigError, match="the layout's stages hold 4 layers but the model has num_layers=5"):
        HeteroTrainer(model, optax.sgd(0.1), Layout.from_lists([[1]], [[4]]), example_batch=batch)


def test_cli_factory_errors_are_one_line(capsys, tmp_path):
    from cfp.cli.main import main
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    cases = [(f"{broken}:factory", "does not import: ModuleNotFoundError"),
             (f"{tmp_path / 'absent.py'}:factory", "no file"),
             ("json:dumps", "the factory raised TypeError")]
    for spec, message in cases:
        code = main(["train", "--model", spec, "--hetero-configs", "[[1]]", "--steps", "1"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.count("\n") == 0 and message in err, err
