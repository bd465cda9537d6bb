"""Overhead of running an optax update stage by stage (cfp.runtime.optimizer) against one jitted update of the
whole tree, on one device (the stages run one after another here: this measures the partition's own cost --
exchange rounds and one program per unit -- not parallel speed).

    python benchmarks/optimizer_partition.py [--layers 16] [--width 256] [--rounds 20]

For the stacked and list forms of a layered model and clip_by_global_norm + AdamW, it times, interleaved over
``--rounds`` rounds, (a) ``jax.jit`` of ``tx.update`` + ``apply_updates`` on the whole tree and (b) two stages'
partials, combine and update, and prints medians with the spread (measured wall times).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from cfp.runtime.optimizer import OptimizerPartition, StageHolding


def layered(stacked: bool, layers: int, width: int) -> dict:
    key = iter(jax.random.split(jax.random.PRNGKey(0), 3 + layers))
    per = [{"w": jax.random.normal(next(key), (width, width)), "b": jnp.zeros((width,))} for _ in range(layers)]
    return {"first": {"emb": jax.random.normal(next(key), (1000, width))},
            "layers": jax.tree.map(lambda *x: jnp.stack(x), *per) if stacked else per,
            "last": {"head": jax.random.normal(next(key), (width, 1000))}}


def whole_step(tx):
    @jax.jit
    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step


def staged_step(part: OptimizerPartition, holdings):
    stages = [part.stage(h) for h in holdings]
    partials = [jax.jit(st.partials, static_argnums=0) for st in stages]
    combine = jax.jit(part.combine, static_argnums=0)

    def step(grads, states, params):
        glob: dict = {}
        for r in range(part.rounds):
            glob = combine(r, [f(r, g, s, p, glob) for f, g, s, p in zip(partials, grads, states, params)], glob)
        out = [st.update(g, s, p, glob) for st, g, s, p in zip(stages, grads, states, params)]
        return [o[0] for o in out], [o[1] for o in out]
    return stages, step


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    half = args.layers // 2
    holdings = (StageHolding(True, 0, half, False), StageHolding(False, half, args.layers, True))
    for stacked in (True, False):
        params = layered(stacked, args.layers, args.width)
        grads, state = jax.tree.map(jnp.ones_like, params), tx.init(params)
        part = OptimizerPartition.of(tx, params)
        stages, staged = staged_step(part, holdings)
        cut = ([st.cut_params(grads) for st in stages], [st.cut_state(state) for st in stages],
               [st.cut_params(params) for st in stages])
        whole = whole_step(tx)
        timed(whole, grads, state, params), timed(staged, *cut)        # compile
        a, b = [], []
        for _ in range(args.rounds):
            a.append(timed(whole, grads, state, params))
            b.append(timed(staged, *cut))
        ratio = [y / x for x, y in zip(a, b)]
        print(f"{'stacked' if stacked else 'list':7} L={args.layers} width={args.width} rounds={part.rounds}: "
              f"whole {statistics.median(a) * 1e3:.2f} ms ({min(a) * 1e3:.2f}-{max(a) * 1e3:.2f}), staged "
              f"{statistics.median(b) * 1e3:.2f} ms ({min(b) * 1e3:.2f}-{max(b) * 1e3:.2f}); staged/whole median "
              f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}), measured")


if __name__ == "__main__":
    main()
