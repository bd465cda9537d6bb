"""A data loader's batches (cfp.runtime.feed): a user model trained by `train_pipelines` and `cfp train --model
file.py:factory` from a list of per-step batches, a generator, a loader-style iterable yielding jax arrays, equal to
the model's own single-device step; resumed from a fresh generator bit for bit; ambiguous values, a batch of
another structure or row count, an exhausted iterator: one-line errors before anything compiles."""
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cfp
from cfp.errors import ConfigError
from cfp.layout import Layout

L, D, V, S, ROWS, STEPS = 3, 16, 32, 8, 8, 3
# two pipelines: TP 2 + TP 1 (2 + 1 layers, 2 micro-batches of 2 rows) and TP 1 x 2 (1 + 2 layers)
LAYOUT = ([[2, 1], [1, 1]], [[2, 1], [1, 2]], [4, 4], [2, 2])
# float32 reordering noise (micro-batches, TP all-reduces, pipeline sums) after 3 AdamW steps against the
# model's own step, measured normwise on this model like tests/test_user_pipelines.py's (<= 5e-7 there); 20x
# that. A batch fed to the wrong step moves the parameters by ~1e-2 (checked below)
TOL = 1e-5
QUIET = dict(log=lambda *a, **k: None)


def _model(tuple_batches: bool = False) -> cfp.LayeredModel:
    """Embedding, L residual tanh-MLP layers (stacked, "mlp" named), head; batches {"x", "y", "w"}, or (with
    `tuple_batches`) a tuple (x, y, w) whose arrays the model finds as the batch's leaves."""
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"first": {"table": jax.random.normal(k[0], (V, D))},
              "layers": {"w1": jax.random.normal(k[1], (L, D, 2 * D)) / np.sqrt(D),
                         "w2": jax.random.normal(k[2], (L, 2 * D, D)) / np.sqrt(2 * D)},
              "last": {"out": jax.random.normal(k[3], (D, V)) / np.sqrt(D)}}
    get = (lambda b, i: jax.tree_util.tree_leaves(b)[i]) if tuple_batches else (lambda b, i: b["xyw"[i]])

    def last(p, x, batch):
        ce = optax.softmax_cross_entropy_with_integer_labels(x @ p["out"], get(batch, 1))
        return jnp.sum(ce * get(batch, 2)), jnp.sum(get(batch, 2))
    return cfp.LayeredModel(first=lambda p, b: p["table"][get(b, 0)],
                            layer=lambda p, x: x + jnp.tanh(x @ p["w1"]) @ p["w2"], last=last, params=params,
                            logical_names={"first": {"table": ("vocab", "embed")},
                                           "layers": {"w1": (None, "embed", "mlp"), "w2": (None, "mlp", "embed")},
                                           "last": {"out": ("embed", "vocab")}}, name="feed-mlp")


def _batches(n: int = STEPS, rows: int = ROWS):
    rng = np.random.default_rng(3)
    return [{"x": rng.integers(0, V, (rows, S)).astype(np.int32), "y": rng.integers(0, V, (rows, S)).astype(np.int32),
             "w": (rng.random((rows, S)) < 0.8).astype(np.float32)} for _ in range(n)]


def _own_steps(model, tx, batches):
    """The model's own single-device training: its whole loss (written out here, not cfp's), optax on the tree."""
    def loss(p, b):
        x = p["first"]["table"][b["x"]]
        for i in range(L):
            x = x + jnp.tanh(x @ p["layers"]["w1"][i]) @ p["layers"]["w2"][i]
        ce = optax.softmax_cross_entropy_with_integer_labels(x @ p["last"]["out"], b["y"])
        return jnp.sum(ce * b["w"]) / jnp.sum(b["w"])

    @jax.jit
    def step(p, o, b):
        value, g = jax.value_and_grad(loss)(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value
    p = jax.tree_util.tree_map(jnp.asarray, model.params)
    o, losses = tx.init(p), []
    for b in batches:
        p, o, value = step(p, o, b)
        losses.append(float(value))
    return losses, jax.tree_util.tree_map(np.asarray, p)


def _rel(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
    return (num / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)) ** 0.5


class Loader:
    """A loader in the style of grain's DataLoader: iterable (a fresh pass per `iter`), yields jax arrays."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return ({k: jnp.asarray(v) for k, v in b.items()} for b in self.batches)


@pytest.fixture(scope="module")
def setup():
    from cfp.runtime.stage.cache import CompileCache
    model, tx = _model(), optax.adamw(1e-2, weight_decay=0.1)
    batches = _batches()
    return model, tx, batches, CompileCache(model, tx), _own_steps(model, tx, batches)


@pytest.mark.parametrize("form", ["list", "generator", "loader"])
def test_per_step_batches_train_like_the_models_own_step(setup, form):
    model, tx, batches, cache, (own_losses, own_params) = setup
    given = {"list": lambda: list(batches), "generator": lambda: (b for b in batches),
             "loader": lambda: Loader(batches)}[form]()
    r = cfp.train_pipelines(model, tx, Layout.from_lists(*LAYOUT), given, steps=STEPS, verify=form == "generator",
                            cache=cache, **QUIET)
    np.testing.assert_allclose([r.losses[s] for s in range(1, STEPS + 1)], own_losses, rtol=TOL)
    assert _rel(r.params, own_params) < TOL
    assert _rel(model.params, own_params) > 100 * TOL           # the steps moved the parameters
    if form == "generator":                                     # the replay of --verify read the kept batches
        assert r.verify_ok and r.verify_error < 1e-4
    # each step trained on its own batch: the same batches in another order give other parameters
    _, swapped = _own_steps(model, tx, batches[::-1])
    assert _rel(swapped, own_params) > 100 * TOL


def test_generator_resumes_bit_for_bit(setup, tmp_path):
    """Stopped after step 2 and resumed from a fresh generator (which reads step 1-2's items again and drops
    them): the losses of the uninterrupted run."""
    model, tx, _, cache, _ = setup
    batches = _batches(4)
    kw = dict(steps=4, cache=cache, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, **QUIET)
    full = cfp.train_pipelines(model, tx, Layout.from_lists(*LAYOUT), list(batches), cache=cache, steps=4, **QUIET)
    cfp.train_pipelines(model, tx, Layout.from_lists(*LAYOUT), (b for b in batches), stop_after=2, **kw)
    resumed = cfp.train_pipelines(model, tx, Layout.from_lists(*LAYOUT), (b for b in batches), resume=True, **kw)
    assert sorted(resumed.losses) == [1, 2, 3, 4]
    assert [resumed.losses[s] for s in (3, 4)] == [full.losses[s] for s in (3, 4)]


def _no_compile(monkeypatch):
    """Building the stages (where compiling starts) fails the test: the error must come before it."""
    import cfp.runtime.engine as engine

    def built(*a, **k):
        raise AssertionError("the stages were built before the batches were checked")
    monkeypatch.setattr(engine, "HeteroTrainer", built)


def _one_line_error(model, given, match, **kw):
    with pytest.raises(ConfigError) as e:
        cfp.train_pipelines(model, optax.sgd(0.1), Layout.from_lists(*LAYOUT), given, steps=STEPS, **QUIET, **kw)
    assert match in str(e.value) and "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_a_batch_of_another_structure_is_one_line_before_compiling(monkeypatch):
    _no_compile(monkeypatch)
    model, batches = _model(), _batches()
    bad = [batches[0], {"x": batches[1]["x"], "y": batches[1]["y"]}, batches[2]]        # step 1 has no "w"
    message = _one_line_error(model, bad, "step 1's batch {['x']: int32[8, 8], ['y']: int32[8, 8]} differs from "
                                          "the example batch (step 0's)")
    assert "every batch needs its structure and dtypes" in message
    wider = [batches[0], dict(batches[1], w=batches[1]["w"].astype(np.float16)), batches[2]]
    _one_line_error(model, wider, "step 1's batch")                                     # another dtype
    _one_line_error(model, [batches[0]] + _batches(2, rows=6), "step 1's batch {['w']: float32[6, 8], "
                    "['x']: int32[6, 8], ['y']: int32[6, 8]} has 6 rows; the layout's global batch is 8 rows")
    # a step-0 batch the model cannot take: the model's own one-line reason, not an exception inside `first`
    _one_line_error(model, [{"inputs": b["x"]} for b in batches], "step 0's batch {['inputs']: int32[8, 8]}: "
                    "first(params['first'], batch) failed: KeyError")


def test_a_generators_later_batch_is_checked_before_its_step(setup):
    model, tx, batches, cache, _ = setup
    gen = (b if s != 2 else {"x": b["x"]} for s, b in enumerate(batches))
    message = _one_line_error(model, gen, "step 2's batch {['x']: int32[8, 8]} differs from the example batch",
                              cache=None)
    assert "\n" not in message


def test_values_of_no_form_and_ambiguous_values_are_one_line(monkeypatch):
    _no_compile(monkeypatch)
    model = _model()
    for given, match in ((None, "batches=None is not batches; give a callable batches(step, rows) -> batch; one "
                                "batch"), ("data.npz", "batches='data.npz' is not batches"),
                         (3, "batches of type int is not batches"), ([], "batches is an empty list")):
        _one_line_error(model, given, match)
    # a tuple (x, y, w) per step: the leaves-reading model takes the list as per-step batches and as one batch
    tup = [tuple(b[k] for k in "xyw") for b in _batches()]
    _one_line_error(_model(tuple_batches=True), tup, "batches: a list of 3 the model takes both as per-step "
                    "batches and as one batch; say which: iter(batches) for per-step batches")
    with pytest.raises(ConfigError, match="the iterator ended after 3 batches; the run needs step 3's"):
        from cfp.runtime.feed import step_batches
        feed = step_batches(iter(_batches()), model).for_run(ROWS, replay=False)
        [feed(s) for s in range(4)]


def test_one_batch_and_callable_forms_stay(setup):
    """One batch (rows taken in turn) and the callable give the per-step list's batches: the same bits fed."""
    from cfp.runtime.feed import step_batches
    model, _, batches, _, _ = setup
    whole = {k: np.concatenate([b[k] for b in batches]) for k in "xyw"}
    forms = [step_batches(whole, model), step_batches(lambda s, rows: batches[s], model),
             step_batches(batches, model), step_batches(tuple(batches), model), step_batches(Loader(batches), model)]
    for feed in forms:
        got = [feed(s, ROWS) for s in range(STEPS)]
        for g, b in zip(got, batches):
            assert all(np.array_equal(g[k], b[k]) for k in "xyw")
    # a (x, y, w) tuple that only one batch fits is one batch; a list the engine would take as micro-batch
    # lists is handed on as a tuple
    tup_model = _model(tuple_batches=True)
    one = step_batches([whole[k] for k in "xyw"], tup_model)
    assert isinstance(one(0, ROWS), tuple) and np.array_equal(one(1, ROWS)[0], batches[1]["x"])


FACTORY = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import optax
    from test_feed import _batches, _model

    def factory():
        return _model(), (b for b in _batches()), optax.adamw(1e-2, weight_decay=0.1)

    def wrong():
        bs = _batches()
        return _model(), [bs[0], {{"x": bs[1]["x"]}}, bs[2]], optax.sgd(0.1)
""")


def test_cli_factory_yielding_batches(tmp_path, capsys):
    import os

    from cfp.cli.main import main
    path = tmp_path / "loader_factory.py"
    path.write_text(FACTORY.format(tests=os.path.dirname(__file__)))
    layout = ["--hetero-configs", "[[2,1],[1,1]]", "--layer-partitions", "[[2,1],[1,2]]", "--global-batch-size",
              "4", "4", "--chunks", "2", "2", "--steps", str(STEPS)]
    code = main(["train", "--model", f"{path}:factory", *layout, "--verify"])
    out = capsys.readouterr()
    assert code == 0, out.out[-2000:] + out.err[-2000:]
    assert f"over {STEPS} steps (ok" in out.out
    code = main(["train", "--model", f"{path}:wrong", *layout])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "the factory's batches: step 1's batch {['x']: int32[8, 8]} " \
        "differs from the example batch" in err, err


def test_planning_takes_step_0s_batch_at_any_rows(setup):
    """`cfp plan --model file.py:factory` derives cost facts on an example of --example-rows rows: from per-step
    batches, step 0's rows cut or cycled to that count."""
    from cfp.runtime.feed import step_batches
    model, _, batches, _, _ = setup
    for given in (batches, Loader(batches), lambda s, rows: {k: v[:rows] for k, v in batches[s].items()}):
        for rows in (3, ROWS):
            ex = step_batches(given, model).example(rows)
            assert all(np.array_equal(ex[k], batches[0][k][:rows]) for k in "xyw")
    ex = step_batches(batches, model).example(ROWS + 2)
    assert np.array_equal(ex["x"], np.concatenate([batches[0]["x"], batches[0]["x"][:2]]))
