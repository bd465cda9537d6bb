"""Batching methods 0/1/3/4 side by side on the same data, the same steps and the same devices (8 CPU devices).

Steps are interleaved (step k of every method, then step k+1), so a change in machine load hits all methods
alike; compilation is excluded from the timed step (each method's first use of a shape compiles outside it).
Figures are measured. Usage:
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
    args = ap.parse_args()

    import jax
    import optax

    from cfp.data import train
    from cfp.data.batching import get_method
    from cfp.data.scheme_space import measure_space
    from cfp.data.schemes import SchemeSpace
    from cfp.data.sources import load_sequences
    from cfp.models import get_config, init_params
    from cfp.runtime.varlen import VarlenTrainer

    cfg = get_config(args.model, args.config, seq_len=args.max_seq_len)
    data = load_sequences(args.input, max_seq_len=args.max_seq_len)
    params = init_params(args.model, cfg, 0)
    if os.path.exists(args.schemes):
        space = SchemeSpace.load(args.schemes)
    else:
        space = measure_space(args.model, args.config, cfg, params, args.memory_mb, log=print)
        space.save(args.schemes)
    print(f"scheme space: {space.source}")
    runners: dict = {}
    runs = []
    for number in (int(m) for m in args.methods.split(",")):
        method = get_method(number)
        pick = train.propose if method.heterogeneous else train.uniform_strategy
        strategy = pick(space, data.lengths, jax.device_count(), args.tokens_per_step)
        opts = train.DataTrainOptions(args.model, method, args.steps, args.tokens_per_step)
        trainer = VarlenTrainer(args.model, cfg, params, optax.adamw(1e-3), runners=runners)
        runs.append([method, strategy, opts, trainer, 0, 0, 0.0, None])
        print(f"method {number} ({method.name}): {strategy.describe()}")
    for step in range(args.steps):
        for r in runs:
            method, strategy, opts, trainer = r[:4]
            train.use_strategy(trainer, strategy)
            st, n_mb = train.train_step(opts, data, trainer, strategy, step)
            r[4] += st.real_tokens
            r[5] += st.padded_tokens
            r[6] += st.seconds
            r[7] = st.loss
            print(f"  step {step + 1} method {method.number}: {st.real_tokens} tokens, {n_mb} micro-batches, "
                  f"{st.seconds:.2f} s, loss {st.loss:.4f}")
    print(f"\n{'method':<36} {'non-pad tokens/s':>17} {'padding':>8} {'last loss':>10}   (measured, "
          f"{args.steps} steps x {args.tokens_per_step} tokens, {jax.device_count()} {jax.devices()[0].platform}"
          f" devices)")
    base = runs[0][4] / runs[0][6]
    for method, strategy, _, _, real, slots, secs, loss in runs:
        tps = real / secs
        print(f"{method.number} {method.name:<34} {tps:>17.0f} {100 * (1 - real / slots):>7.1f}% {loss:>10.4f}"
              f"   x{tps / base:.2f} vs method {runs[0][0].number}")


if __name__ == "__main__":
    main()
