"""cfp.runtime.optimizer: any optax transformation run stage by stage equals optax on one device.

Each case splits a layered model (first, L = 5 layers, last; stacked and list forms) into uneven stages, runs
three steps through partials / combine / update, merges the stages and compares with ``tx.update`` +
``optax.apply_updates`` on the whole tree on one device.

Tolerance (measured noise): the one-device reference runs in float32 and in float64. Per leaf, the partitioned
float32 result may differ from the float64 one by at most 8x what the float32 reference itself differs from it
(its noise, measured in the test on the machine running it), plus 4 float32 ulps of the leaf's magnitude (for
leaves the float32 reference happens to get exactly). Only the order of cross-stage sums (and XLA's fusion of
the per-stage programs) differs from the float32 reference: measured over these cases the partitioned error was
at most 1.79x the reference's own (clip-adamw, stacked; 1.0x where nothing crosses stages). The check can fail:
the tolerance must stay under 1% of the three steps' parameter change (measured: at most 0.16%, lion), and a
global norm taken over one stage's layers only (mutant `optimizer-layer-reduction-one-stage`) exceeds it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cfp.errors import ConfigError
from cfp.runtime.optimizer import OptimizerPartition, StageHolding

LAYERS = 5
# pipeline 0: three uneven stages; pipeline 1: a stage holding "first" alone, then two more
SPLIT_A = (StageHolding(True, 0, 2, False), StageHolding(False, 2, 4, False), StageHolding(False, 4, 5, True))
SPLIT_B = (StageHolding(True, 0, 0, False), StageHolding(False, 0, 3, False), StageHolding(False, 3, 5, True))
F32_ULP = float(np.finfo(np.float32).eps)


def layered(stacked: bool, seed: int = 0) -> dict:
    """A layered parameter tree: factored (>= 128 x 128) and small leaves in every part."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + 2 * LAYERS))
    normal = lambda shape: jax.random.normal(next(keys), shape, jnp.float32)
    layers = [{"w": normal((128, 130)), "b": normal((8,))} for _ in range(LAYERS)]
    if stacked:
        layers = jax.tree.map(lambda *x: jnp.stack(x), *layers)
    return {"first": {"emb": normal((130, 128)), "scale": normal((8,))}, "layers": layers,
            "last": {"head": normal((8, 3))}}


def random_grads(params: dict, step: int) -> dict:
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(100 + step), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def reference(tx, params, grads_seq, dtype):
    """tx.update + apply_updates on the whole tree on one device, in ``dtype``."""
    cast = lambda t: jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, t)

    @jax.jit
    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    params = cast(params)
    state = tx.init(params)
    for g in grads_seq:
        params, state = step(cast(g), state, params)
    return jax.device_get((params, state))


class Pipeline:
    """One pipeline's stages of a partition, with jitted programs."""

    def __init__(self, part: OptimizerPartition, split, params, state, donate: bool = False):
        self.part, self.split, self.donate = part, split, donate
        self.stages = [part.stage(h) for h in split]
        self.params = [st.cut_params(params) for st in self.stages]
        self.state = [st.cut_state(state) for st in self.stages]
        self.update = [st.update for st in self.stages]     # unit programs, compiled once per unit
        self.partials = [jax.jit(st.partials, static_argnums=0) for st in self.stages]

    def globals_(self, grads) -> dict:
        combine = jax.jit(self.part.combine, static_argnums=0)
        glob: dict = {}
        for r in range(self.part.rounds):
            parts = [f(r, st.cut_params(grads), s, p, glob)
                     for f, st, s, p in zip(self.partials, self.stages, self.state, self.params)]
            glob = combine(r, parts, glob)
        return glob

    def step(self, grads, glob) -> None:
        out = [f(st.cut_params(grads), s, p, glob, donate=self.donate)
               for f, st, s, p in zip(self.update, self.stages, self.state, self.params)]
        self.params, self.state = [o[0] for o in out], [o[1] for o in out]

    def merged(self):
        return self.part.merge(list(zip(self.split, self.params, self.state)))


def partitioned(tx, params, grads_seq, split=SPLIT_A):
    part = OptimizerPartition.of(tx, params)
    pipe = Pipeline(part, split, params, tx.init(params))
    for g in grads_seq:
        pipe.step(g, pipe.globals_(g))
    return part, pipe.merged()


def assert_matches_one_device(tx, stacked: bool) -> OptimizerPartition:
    params = layered(stacked)
    grads_seq = [random_grads(params, s) for s in range(3)]
    part, got = partitioned(tx, params, grads_seq)
    ref32 = reference(tx, params, grads_seq, jnp.float32)
    with jax.enable_x64(True):
        ref64 = reference(tx, params, grads_seq, jnp.float64)
    change = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                 for a, b in zip(jax.tree.leaves(ref64[0]), jax.tree.leaves(params)))
    flat = zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref32), jax.tree.leaves(ref64))
    for (path, mine), r32, r64 in flat:
        mine, r32, r64 = (np.asarray(x, np.float64) for x in (mine, r32, r64))
        assert np.all(np.isfinite(mine)), path
        noise = np.max(np.abs(r32 - r64), initial=0.0)
        tol = 8 * noise + 4 * F32_ULP * np.max(np.abs(r64), initial=0.0)
        err = np.max(np.abs(mine - r64), initial=0.0)
        assert err <= tol, f"{jax.tree_util.keystr(path)}: |partitioned - float64| {err:.3g} > {tol:.3g}"
        if path[0] == 0:     # parameters: the tolerance must be able to see a wrong update
            assert tol < 0.01 * change, f"{jax.tree_util.keystr(path)}: tolerance {tol:.3g} vs change {change:.3g}"
    return part


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
OPTIMIZERS = {
    "adamw-schedule": lambda: optax.adamw(SCHEDULE, weight_decay=0.1),
    "clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE)),
    "adafactor": lambda: optax.adafactor(),
    "lion": lambda: optax.lion(1e-3),
    "sgd-nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
}


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_stages_match_one_device(name, stacked):
    part = assert_matches_one_device(OPTIMIZERS[name](), stacked)
    if name == "clip-adamw":
        assert part.rounds == 1          # the global norm: one exchange, whatever the number of units
    if name in ("adamw-schedule", "lion", "sgd-nesterov", "adam"):
        assert part.rounds == 0          # elementwise: no exchange at all


def test_clip_really_clips():
    """The clip case is a real test of the global norm: the gradients' norm is far above the threshold."""
    params = layered(True)
    norm = float(optax.global_norm(random_grads(params, 0)))
    assert norm > 100.0


def test_scalar_crossing_stages_is_exact():
    """A custom transformation scaling "first"'s update by a norm of "last"'s gradient (a scalar crossing
    stages) is accepted and matches one device."""
    def update(g, s, p=None):
        scale = jnp.sum(jnp.square(g["last"]["head"]))
        g = {**g, "first": jax.tree.map(lambda x: x * scale * 1e-3, g["first"])}
        return g, s

    tx = optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), update), optax.sgd(1e-2))
    part = assert_matches_one_device(tx, stacked=True)
    assert part.rounds == 1


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("name", ["clip-adamw", "adafactor"])
def test_pipelines_with_other_boundaries_stay_bit_identical(name, stacked):
    """Two pipelines with different stage boundaries, fed the same summed gradients, with the global values
    of pipeline 0's partials handed to both, hold bit-identical parameters and state (the second one gives
    its buffers to the update: donated, the same bits)."""
    tx = OPTIMIZERS[name]()
    params = layered(stacked)
    part = OptimizerPartition.of(tx, params)
    state = tx.init(params)
    copy = lambda t: jax.tree.map(jnp.copy, t)
    pipes = [Pipeline(part, SPLIT_A, params, state), Pipeline(part, SPLIT_B, copy(params), copy(state), True)]
    assert {v.shape for v in part.globals_like().values()} <= {()}      # scalars cross stages
    for s in range(3):
        g = random_grads(params, s)
        glob = pipes[0].globals_(g)
        for pipe in pipes:
            pipe.step(copy(g), glob)
    a, b = (jax.tree.leaves(pipe.merged()) for pipe in pipes)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["clip-adamw", "adamw-schedule"])
def test_nan_in_a_gradient_propagates(name):
    """A NaN in one stacked gradient element (on the second stage) reaches the same parameters as on one device:
    every parameter under a global norm, that element only under AdamW."""
    tx = OPTIMIZERS[name]()
    params = layered(True)
    g = random_grads(params, 0)
    g["layers"]["w"] = g["layers"]["w"].at[3, 5, 7].set(jnp.nan)
    _, (got, _) = partitioned(tx, params, [g])
    want, _ = reference(tx, params, [g], jnp.float32)
    for mine, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.isnan(mine), np.isnan(ref))
    nans = sum(int(np.isnan(x).sum()) for x in jax.tree.leaves(got))
    assert nans == (sum(x.size for x in jax.tree.leaves(got)) if name == "clip-adamw" else 1)


def _one_line_error(tx, params) -> str:
    with pytest.raises(ConfigError) as info:
        OptimizerPartition.of(tx, params)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_flatten_is_refused(stacked):
    message = _one_line_error(optax.flatten(optax.adam(1e-3)), layered(stacked))
    assert "params['" in message and ("concatenate" in message or "reshape" in message)


@pytest.mark.parametrize("into", ["first", "last"])
def test_mixing_two_leaves_whole_gradients_is_refused(into):
    """The mix is refused where it happens, whichever leaf receives it."""
    def update(g, s, p=None):
        mixed = g["first"]["scale"] + g["last"]["head"][:, 0]
        if into == "first":
            return {**g, "first": {**g["first"], "scale": mixed}}, s
        return {**g, "last": {"head": g["last"]["head"] + mixed[:, None]}}, s

    tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
    message = _one_line_error(tx, layered(False))
    assert "`add` combines" in message
    assert "params['first']['scale']" in message and "params['last']['head']" in message


def test_mixing_layers_of_a_stacked_leaf_is_refused():
    def update(g, s, p=None):
        return {**g, "layers": jax.tree.map(lambda x: x[::-1], g["layers"])}, s

    tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
    message = _one_line_error(tx, layered(True))
    assert "layer-stacked params['layers']" in message and "`rev`" in message


def test_a_reshape_across_layers_is_refused():
    """Stacked ``b`` is (5, 8): as (8, 5) a row holds parts of two layers, so no stage could compute its own."""
    def update(g, s, p=None):
        b = g["layers"]["b"]
        return {**g, "layers": {**g["layers"], "b": (b.reshape(8, 5) * 2.0).reshape(b.shape)}}, s

    tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
    message = _one_line_error(tx, layered(True))
    assert "`reshape` splits a layer's rows" in message and "params['layers']['b']" in message


def test_a_reshape_keeping_layers_whole_runs_per_stage():
    """Flattening each layer's rows into dim 0 (as ``jnp.vdot`` does) keeps layers whole: accepted, exact."""
    def update(g, s, p=None):
        w = g["layers"]["w"]
        scale = jnp.vdot(w, w) / w.size                  # a reshape to (L * 128 * 130,) and a sum over layers
        return {**g, "layers": {**g["layers"], "w": (w.reshape(-1, 65) / jnp.sqrt(scale)).reshape(w.shape)}}, s

    tx = optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), update), optax.sgd(1e-2))
    assert assert_matches_one_device(tx, stacked=True).rounds == 1


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_stage_init_equals_the_cut_of_the_whole_init(stacked):
    tx = optax.adafactor()
    params = layered(stacked)
    part = OptimizerPartition.of(tx, params)
    whole = tx.init(params)
    for h in SPLIT_A:
        st = part.stage(h)
        mine, cut = st.init(st.cut_params(params)), st.cut_state(whole)
        assert mine.keys() == cut.keys()
        assert all(np.array_equal(mine[k], cut[k]) for k in cut)


def test_state_leaves_name_their_parameter():
    part = OptimizerPartition.of(optax.adam(1e-3), layered(True))
    links = part.param_of_state()
    assert links["[0].mu['layers']['w']"] == "['layers']['w']"
    assert "[0].count" not in links
    count = part.stage(SPLIT_A[1]).state_like["[0].count"]
    assert count.shape == ()                   # replicated: every stage keeps its own copy


def test_a_pipeline_must_hold_every_part_once():
    part = OptimizerPartition.of(optax.adam(1e-3), layered(True))
    part.check_pipeline(SPLIT_A)
    for bad in ((SPLIT_A[0], SPLIT_A[2]), (SPLIT_A[0], SPLIT_A[0], SPLIT_A[1], SPLIT_A[2]), SPLIT_A[::-1]):
        with pytest.raises(ConfigError, match="must hold first once"):
            part.check_pipeline(bad)
    with pytest.raises(ConfigError, match="exceed"):
        part.stage(StageHolding(False, 3, 6, True))
    with pytest.raises(ConfigError, match="keys first, layers, last"):
        OptimizerPartition.of(optax.adam(1e-3), {"layers": []})
