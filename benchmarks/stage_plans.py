"""Megatron stage shardings vs searched stage plans, side by side, on layouts where they differ.

    python benchmarks/stage_plans.py [--steps 6] [--profiler measure|estimate] [--gpu A100-SXM-80G]
                                     [--layouts vocab moe] [--verify N] [--max-combinations N]

Layouts (8 simulated CPU devices):
  vocab — llama2, 2 layers, vocab 8192: pipeline [TP2 stage: embed + layer 0, TP4 stage: layer 1 + the wide head],
          global batch 8 in 2 micro-batches;
  moe   — MoE (4 experts), 2 layers: one pipeline of a TP4 stage holding everything, batch 4 in 1 micro-batch.
For each layout the stage plans are searched (planning time printed, with a fresh profile cache unless
--cache-dir is given, then searched again to show the profile cache: the second search profiles nothing; each
stage's search also times its winner side by side with the stage's Megatron sharding and keeps the faster),
then the Megatron trainer and the searched trainer run alternating steps (the first of each is a warm-up) so
both see the same machine state. Printed per layout: tokens/s of each (measured, mean over the timed steps),
their ratio, per stage which sharding runs, the measured busy seconds per step and the persistent state
(parameters + optimizer state) per device, measured from the placed arrays.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cfp.cli.common import ensure_host_devices  # noqa: E402

LAYOUTS = {
    "vocab": ("llama2", dict(num_layers=2, vocab_size=8192, seq_len=32),
              ([[2, 4]], [[1, 1]], [8], [2])),
    "moe": ("moe", dict(num_layers=2, seq_len=32), ([[4]], [[2]], [4], [1])),
}


def _state_bytes(tree) -> int:
    """Bytes one device holds of `tree` (the first device's shard of every leaf)."""
    import jax
    return sum(l.addressable_shards[0].data.nbytes for l in jax.tree_util.tree_leaves(tree))


def _run(name: str, args) -> None:
    import jax
    import numpy as np
    from cfp.layout import Layout
    from cfp.models import get_config
    from cfp.models.layered import zoo_model
    from cfp.runtime.engine import HeteroTrainer, adamw, zoo_trainer
    from cfp.runtime.stage.cache import CompileCache
    from cfp.runtime.stage.plans import StagePlanOptions
    from cfp.runtime.stage.plan_search import search_stage_plans
    from cfp.models import make_batch
    model, overrides, lists = LAYOUTS[name]
    cfg = get_config(model, "tiny", **overrides)
    layout = Layout.from_lists(*lists)
    example = jax.tree_util.tree_map(np.asarray, make_batch(model, cfg, 1, 0))
    compile_cache = lambda: CompileCache(zoo_model(model, cfg, 0), adamw(1e-3, 0.01))  # noqa: E731
    programs = compile_cache()    # the searched run's: its trainer runs the programs the search built
    import tempfile
    cache = args.cache_dir or tempfile.mkdtemp(prefix="cfp_stage_plans_bench_")
    from cfp.search.options import SearchOptions
    given = {"verify": args.verify, "max_combinations": args.max_combinations}
    opts = StagePlanOptions("search", search=SearchOptions().replace(
        kind=args.profiler, gpu=args.gpu, cache_dir=cache, **{k: v for k, v in given.items() if v is not None}))
    print(f"\n== {name}: {model} {overrides}, layout {lists[0]} layers {lists[1]} batch {lists[2]} "
          f"chunks {lists[3]}")
    t0 = time.perf_counter()
    plans = search_stage_plans(layout, programs, opts, example, log=print)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = search_stage_plans(layout, compile_cache(), opts, example, log=lambda *_: None)
    t_again = time.perf_counter() - t0
    print(f"planning time (measured): {t_plan:.1f} s{' (fresh profile cache)' if not args.cache_dir else ''}; "
          f"again with the profile cache {t_again:.1f} s "
          f"({sum(p.figures.profile_compiles for p in again.plans if p.figures)} profile compiles)")
    trainers = {"megatron": zoo_trainer(model, cfg, layout, learning_rate=1e-3, example_batch=example),
                "searched": HeteroTrainer(programs.model, None, layout, plans=plans, cache=programs,
                                          example_batch=example)}
    for t in trainers.values():
        t.init()
        t.compile()
    batches = [jax.tree_util.tree_map(np.asarray, make_batch(model, cfg, layout.global_batch, s))
               for s in range(args.steps)]
    stats = {k: [] for k in trainers}
    for s, b in enumerate(batches):
        for k, t in trainers.items():
            st = t.step(b)
            if not np.isfinite(st.loss):
                raise SystemExit(f"{name} {k}: loss {st.loss} at step {s + 1}")
            if s > 0:
                stats[k].append(st)
    tps = {}
    for k, ss in stats.items():
        tps[k] = sum(x.tokens for x in ss) / sum(x.seconds for x in ss)
        busy, n = {}, {}     # a stage's busy seconds from the steps its every action was measured in
        for x in ss:
            for key, v in x.busy().items():
                if key not in x.unmeasured:
                    busy[key], n[key] = busy.get(key, 0.0) + v, n.get(key, 0) + 1
        busy = {key: v / n[key] for key, v in busy.items()}
        mem = {key: _state_bytes((trainers[k].params[key], trainers[k].opt_state[key]))
               for key in trainers[k].params}
        print(f"{k:9s} tokens/s {tps[k]:,.0f} (measured, {len(ss)} steps); per stage (busy measured over the "
              f"steps its every action was measured in): " + "; ".join(
            f"p{key[0]}s{key[1]} busy " + (f"{busy[key]:.4f} s/step" if key in busy else "not measured")
            + f", state {mem[key] / 2**20:.2f} MiB/device"
            for key in sorted(mem)))
    for p in plans.plans:
        runs = "replicated (same as Megatron's)" if not p.sharding else ("Megatron" if p.megatron else "searched")
        f = p.figures
        side = (f"; side by side per micro-batch step: searched {f.searched.time * 1e3:.2f} ms, Megatron "
                f"{f.megatron.time * 1e3:.2f} ms ({'estimated' if f.profiler.startswith('estimate') else 'measured'})"
                if f and f.megatron and f.megatron.time else "")
        print(f"  plan p{p.pipeline}s{p.stage} TP {p.tp}: {runs} runs{side}; {p.summary()}")
    if not any(p.runs_searched for p in plans.plans):
        # both trainers run every stage's Megatron sharding: a ratio would compare a sharding with itself
        print("ratio searched / megatron tokens/s: same sharding (every stage runs its Megatron sharding)")
    else:
        print(f"ratio searched / megatron tokens/s: {tps['searched'] / tps['megatron']:.2f}x (measured)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profiler", choices=("measure", "estimate"), default="measure")
    ap.add_argument("--gpu", default=None)
    ap.add_argument("--cache-dir", default=None, help="profile cache (default: cfp's)")
    ap.add_argument("--verify", type=int, default=None,
                    help="DP solutions each stage search verifies whole (default: SearchOptions')")
    ap.add_argument("--max-combinations", type=int, default=None,
                    help="combinations profiled per segment kind (default: SearchOptions')")
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=sorted(LAYOUTS))
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (each trainer's first step is a warm-up, not timed)")
    ensure_host_devices(8)
    for name in args.layouts:
        _run(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
