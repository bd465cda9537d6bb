"""Batching methods 0/1/3/4 side by side on the training engine: same data, same steps, same devices (8 CPU devices).

Runs: methods 0 and 1 on the best single-scheme strategy, methods 3 and 4 on the strategy `cfp data propose`
finds for the scheme space, and methods 3 and 4 on Hydraulis-notation strategies (`--strategies`, default a
heterogeneous strategy with a pp=2 pipeline beside pp=1 ones, one with cp=2, and a uniform pp=2 one; each step
runs the one the fitted costs rate fastest; with method 4 also each of them alone). Steps are interleaved (step k of every run, then step k+1), so a
change in machine load hits all runs alike; compilation is excluded from the timed step (each run's first use
of a micro-batch shape is compiled by `HeteroTrainer.warm` outside it). Figures are measured. Usage:
    python benchmarks/batching.py [--steps 4] [--tokens-per-step 8192] [--schemes parallel_scheme_space.json]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cfp.cli.common import ensure_host_devices, patient_collectives  # noqa: E402

ensure_host_devices(8)
patient_collectives()

HYDRAULIS = "[[(1,2,2),(2,1,1),(1,2,1)], [(1,4,2)]]"


def _space(args, cfg, params, shapes):
    from cfp.data.scheme_space import measure_space
    from cfp.data.schemes import SchemeSpace
    if os.path.exists(args.schemes):
        space = SchemeSpace.load(args.schemes)
        missing = [s for s in shapes if s not in {(x.cp, x.tp, x.pp) for x in space.schemes}]
        if not missing:
            return space
        more = measure_space(args.model, args.config, cfg, params, args.memory_mb, log=print, shapes=missing)
        space = SchemeSpace(space.model, space.config, space.source, space.schemes + more.schemes)
    else:
        space = measure_space(args.model, args.config, cfg, params, args.memory_mb, log=print)
        have = {(x.cp, x.tp, x.pp) for x in space.schemes}
        missing = [s for s in shapes if s not in have]
        if missing:
            more = measure_space(args.model, args.config, cfg, params, args.memory_mb, log=print, shapes=missing)
            space = type(space)(space.model, space.config, space.source, space.schemes + more.schemes)
    space.save(args.schemes)
    return space


def _runs(args, space, data, cfg, params):
    """[label, method, candidates, opts, trainer, real, slots, seconds, last loss, strategies used]."""
    import jax

    from cfp.data import train
    from cfp.data.batching import get_method
    from cfp.models.layered import zoo_params
    from cfp.runtime.engine import zoo_trainer
    layered = zoo_params(params, cfg.num_layers)
    given = train.with_fits(train.parse_strategies(args.strategies), space)
    runs = []
    for number in (int(m) for m in args.methods.split(",")):
        method = get_method(number)
        pick = train.propose if method.heterogeneous else train.uniform_strategy
        sets = [("proposed" if method.heterogeneous else "uniform",
                 [pick(space, data.lengths, jax.device_count(), args.tokens_per_step).pipelines()])]
        if method.heterogeneous:
            sets.append(("Hydraulis, per step", given))
        if method.number == 4 and len(given) > 1:   # each given strategy alone, measured whatever the fits say
            sets += [(f"Hydraulis strategy {i}", [g]) for i, g in enumerate(given)]
        for label, cands in sets:
            opts = train.DataTrainOptions(args.model, method, args.steps, args.tokens_per_step)
            trainer = zoo_trainer(args.model, cfg, train.layout_of(cands[0], cfg.num_layers, jax.device_count()),
                                  opts.schedule, learning_rate=opts.learning_rate, weight_decay=opts.weight_decay)
            trainer.load_state(layered, trainer.tx.init(layered), 0)
            runs.append([label, method, cands, opts, trainer, 0, 0, 0.0, None, set()])
            print(f"method {number} ({method.name}), {label}: " + " | ".join(train.describe(c) for c in cands))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--input", default="stdlib")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens-per-step", type=int, default=8192)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--memory-mb", type=float, default=48.0)
    ap.add_argument("--schemes", default="parallel_scheme_space.json")
    ap.add_argument("--methods", default="0,1,3,4")
    ap.add_argument("--strategies", default=HYDRAULIS, help="Hydraulis-notation strategies run with methods 3 and 4")
    args = ap.parse_args()

    import jax

    from cfp.data import train
    from cfp.data.sources import load_sequences
    from cfp.models import get_config, init_params

    cfg = get_config(args.model, args.config, seq_len=args.max_seq_len)
    data = load_sequences(args.input, max_seq_len=args.max_seq_len)
    params = init_params(args.model, cfg, 0)
    space = _space(args, cfg, params, train.shapes_of(train.parse_strategies(args.strategies)))
    print(f"scheme space: {space.source}")
    runs = _runs(args, space, data, cfg, params)
    layouts = [[train.layout_of(c, cfg.num_layers, jax.device_count()) for c in r[2]] for r in runs]
    for step in range(args.steps):
        for r, lays in zip(runs, layouts):
            label, method, cands, opts, trainer = r[:5]
            st, rec, n_mb = train.train_step(opts, data, trainer, cands, lays, step)
            r[5] += st.real_tokens
            r[6] += st.tokens
            r[7] += st.seconds
            r[8] = st.loss
            r[9].add(rec.strategy)
            print(f"  step {step + 1} method {method.number} {label}: strategy {train.describe(cands[rec.strategy])}, "
                  f"{st.real_tokens} tokens, {n_mb} micro-batches, {st.seconds:.2f} s, loss {st.loss:.4f}")
    print(f"\n{'method':<34} {'strategy':<22} {'non-pad tokens/s':>17} {'padding':>8} {'last loss':>10}   (measured, "
          f"{args.steps} steps x {args.tokens_per_step} tokens, {jax.device_count()} {jax.devices()[0].platform}"
          f" devices)")
    base = runs[0][5] / runs[0][7]
    for label, method, cands, _, _, real, slots, secs, loss, used in runs:
        tps = real / secs
        print(f"{method.number} {method.name:<32} {label:<22} {tps:>17.0f} {100 * (1 - real / slots):>7.1f}% "
              f"{loss:>10.4f}   x{tps / base:.2f} vs method {runs[0][1].number}; ran "
              + " and ".join(train.describe(cands[i]) for i in sorted(used)))


if __name__ == "__main__":
    main()
