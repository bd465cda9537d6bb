"""Past the small cases: every front end (`from_linen`, `from_nnx`, `from_equinox`) with 12 layers in each naming
style it accepts (Linen: ``layers_0 .. layers_11`` submodules, an ``nn.scan`` stack with logical names, other part
names; NNX: a list of modules, other part names, an ``nnx.vmap`` stack; Equinox: a list of modules, an
``eqx.filter_vmap`` stack), trained by cfp on a pipeline of 10 micro-batches (ids past 9) over two stages cut at
layer 7, against the user's own training step: their whole model on one device, their loss, their optax chain (a
global-norm clip and AdamW). Layers put in another order (``layers_10`` before ``layers_2``) or a micro-batch left
out is far outside the tolerance.

Tolerance: normwise relative parameter error after 2 steps; measured 1.5e-8 .. 1.0e-7 over these cases in two
runs (float32 reordering: the micro-batches' sum); the bound 1e-5 is 100x that, and the steps move the
parameters by more than 100x it (checked).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cfp.layout import Layout

L, V, D, S = 12, 32, 8, 4
STEPS = 2
# two TP-1 stages (7 + 5 layers), 10 micro-batches of 1 row
LAYOUT = ([[1, 1]], [[7, 5]], [10], [10])
TOL = 1e-5


def batches() -> list[dict]:
    rng = np.random.default_rng(0)
    rows = sum(LAYOUT[2])
    out = []
    for _ in range(STEPS):
        toks = rng.integers(0, V, (rows, S + 1)).astype(np.int32)
        out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    return out


def loss(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return jnp.sum(ce), jnp.float32(ce.size)


def optimizer():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def own_training(value_and_grad, params):
    """The user's step on one device: mean loss over the whole batch, their optimizer on their own tree."""
    tx = optimizer()

    @jax.jit
    def step(p, o, b):
        value, g = value_and_grad(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    opt = tx.init(params)
    for b in batches():
        params, opt = step(params, opt, b)
    return params


def rel(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) and all(np.shape(x) == np.shape(y) for x, y in zip(la, lb))
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
    return (num / sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)) ** 0.5


# ----------------------------------------------------------------------------- Linen
def linen_case(style: str):
    import flax.linen as nn
    named = nn.with_logical_partitioning if style == "scan" else (lambda init, names: init)
    init = nn.initializers.lecun_normal()

    class Embed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Embed(V, D, embedding_init=named(nn.initializers.normal(1.0), ("vocab", "embed")))(x)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(2 * D, kernel_init=named(init, ("embed", "mlp")))(x))
            return x + nn.Dense(D, kernel_init=named(init, ("mlp", "embed")))(h)

    class ScanBlock(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return Block()(x), None

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(V, kernel_init=named(init, ("embed", "vocab")))(x)

    e, l, h = ("tok", "blocks", "out") if style == "names" else ("embed", "layers", "head")

    class LM(nn.Module):
        def setup(self):
            setattr(self, e, Embed())
            setattr(self, h, Head())
            if style == "scan":
                setattr(self, l, nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                                         length=L, metadata_params={nn.PARTITION_NAME: None})())
            else:
                setattr(self, l, [Block() for _ in range(L)])

        def __call__(self, x):
            x = getattr(self, e)(x)
            if style == "scan":
                x, _ = getattr(self, l)(x, None)
            else:
                for block in getattr(self, l):
                    x = block(x)
            return getattr(self, h)(x)

    import cfp
    lm = LM()
    variables = lm.init(jax.random.PRNGKey(0), batches()[0]["inputs"])
    model = cfp.from_linen(Embed(), ScanBlock() if style == "scan" else Block(), Head(), variables["params"], loss,
                           names=(e, l, h))
    plain = nn.meta.unbox(variables["params"])

    def value_and_grad(p, b):
        return jax.value_and_grad(lambda q: (lambda s, w: s / w)(*loss(lm.apply({"params": q}, b["inputs"]), b)))(p)
    own = own_training(value_and_grad, plain)
    layers = own[l] if style == "scan" else [own[f"{l}_{i}"] for i in range(L)]
    if style != "scan":
        assert sorted(k for k in plain if k.startswith(l)) != [f"{l}_{i}" for i in range(L)]   # 10 sorts before 2
    return model, {"first": own[e], "layers": layers, "last": own[h]}


# ----------------------------------------------------------------------------- NNX
def nnx_case(style: str):
    from flax import nnx
    import cfp

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    e, l, h = ("tok", "blocks", "out") if style == "names" else ("embed", "layers", "head")

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs):
        return Block(rngs)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def scan(x, block):
        return block(x)

    class LM(nnx.Module):
        def __init__(self, rngs):
            setattr(self, e, nnx.Embed(V, D, rngs=rngs))
            setattr(self, l, stack(rngs) if style == "stacked" else nnx.List([Block(rngs) for _ in range(L)]))
            setattr(self, h, nnx.Linear(D, V, rngs=rngs))

        def __call__(self, x):
            x = getattr(self, e)(x)
            if style == "stacked":
                x = scan(x, getattr(self, l))
            else:
                for block in getattr(self, l):
                    x = block(x)
            return getattr(self, h)(x)

    model = cfp.from_nnx(LM(nnx.Rngs(0)), loss, names=(e, l, h))
    graphdef, state = nnx.split(LM(nnx.Rngs(0)), nnx.Param)

    def value_and_grad(st, b):
        return jax.value_and_grad(lambda q: (lambda s, w: s / w)(*loss(nnx.merge(graphdef, q)(b["inputs"]), b)))(st)
    pure = nnx.to_pure_dict(own_training(value_and_grad, state))
    layers = pure[l] if style == "stacked" else [pure[l][i] for i in range(L)]
    return model, {"first": pure[e], "layers": layers, "last": pure[h]}


# ----------------------------------------------------------------------------- Equinox
def equinox_case(style: str):
    import equinox as eqx
    import cfp

    class Block(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up, self.down = eqx.nn.Linear(D, 2 * D, key=k1), eqx.nn.Linear(2 * D, D, key=k2)

        def __call__(self, x):
            return x + jax.vmap(jax.vmap(self.down))(jnp.tanh(jax.vmap(jax.vmap(self.up))(x)))

    class Embed(eqx.Module):
        table: jax.Array

        def __call__(self, tokens):
            return self.table[tokens]

    class Head(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

    class LM(eqx.Module):
        embed: Embed
        layers: object
        head: Head

        def __init__(self, key):
            k = jax.random.split(key, L + 2)
            self.embed, self.head = Embed(jax.random.normal(k[0], (V, D))), Head(jax.random.normal(k[1], (D, V)))
            if style == "stacked":
                self.layers = eqx.filter_vmap(Block)(k[2:])
            else:
                self.layers = [Block(kk) for kk in k[2:]]

        def __call__(self, tokens):
            x = self.embed(tokens)
            if style == "stacked":
                params, static = eqx.partition(self.layers, eqx.is_array)
                x, _ = jax.lax.scan(lambda c, p: (eqx.combine(p, static)(c), None), x, params)
            else:
                for block in self.layers:
                    x = block(x)
            return self.head(x)

    lm = LM(jax.random.PRNGKey(0))
    model = cfp.from_equinox(lm, loss)
    params, static = eqx.partition(lm, eqx.is_array)

    def value_and_grad(p, b):
        return jax.value_and_grad(
            lambda q: (lambda s, w: s / w)(*loss(eqx.combine(q, static)(b["inputs"]), b)))(p)
    own = own_training(value_and_grad, params)
    return model, {"first": own.embed, "layers": own.layers, "last": own.head}


CASES = {"linen-layers_i": (linen_case, "list"), "linen-scan-named": (linen_case, "scan"),
         "linen-other-names": (linen_case, "names"), "nnx-list": (nnx_case, "list"),
         "nnx-other-names": (nnx_case, "names"), "nnx-vmap-stacked": (nnx_case, "stacked"),
         "equinox-list": (equinox_case, "list"), "equinox-vmap-stacked": (equinox_case, "stacked")}
# the fast tier keeps the per-layer naming of each front end (where layer ids past 9 could be misordered)
SLOW = {"linen-scan-named", "linen-other-names", "nnx-other-names", "nnx-vmap-stacked",
        "equinox-vmap-stacked"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_twelve_layers_train_like_the_users_own_step(case):
    import cfp
    make, style = CASES[case]
    model, own = make(style)
    assert model.num_layers == L
    result = cfp.train_pipelines(model, optimizer(), Layout.from_lists(*LAYOUT), batches(), steps=STEPS,
                                 log=lambda *a, **k: None)
    assert all(np.isfinite(v) for v in result.losses.values())
    mine = result.params
    if case.startswith("equinox"):
        mine = {"first": mine["first"], "layers": mine["layers"], "last": mine["last"]}
    err = rel(mine, own)
    print(f"{case}: normwise parameter error {err:.2g} against the user's own step")
    assert err < TOL
    assert rel(model.params, own) > 100 * TOL
