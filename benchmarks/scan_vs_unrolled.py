"""A scanned Flax Linen transformer (`nn.scan` over stacked layers) against its unrolled twin, measured side by
side on 8 simulated CPU devices (2x4 mesh).

    python benchmarks/scan_vs_unrolled.py [--layers 4] [--scaling 2,64] [--rounds 10] [--profiler measure]
                                          [--scaling-profiler measure] [--skip-plans]

1. Plans: cfp searches (measure profiler) the scanned model and its unrolled twin (the same `Block`, one
   module per layer); the scanned model's cfp plan, data parallel and FSDP, and the twin's cfp plan and data
   parallel are then timed in turns (interleaved rounds, so load on a shared host lands on all alike).
2. Scaling: analysis, profiling and search time of the scanned model at 2 and at 64 layers (a smaller width),
   each searched `--scaling-runs` times (default 2) in turns; the fastest run counts. Analysis: tracing, blocks,
   segments. Profiling: the
   segments' compiles and runs (the body once, whatever the depth). Search: the memory calibration's whole
   compile, the DP, the verified plans' whole compiles, their side-by-side timing and the loop bodies' figures.
   Under the default `measure` profiler the search runs every verified plan's whole step, whose run time grows
   with the depth (its compile does not); its side-by-side rounds stop at `SearchOptions.timing_budget`
   seconds. The `estimate` profiler runs nothing.
"""
import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import cfp  # noqa: E402
from cfp.analysis.blocks import data_parallel_choice  # noqa: E402
from cfp.search.options import fmt_bytes  # noqa: E402
from cfp.sharding.step import apply_choice  # noqa: E402
from cfp.xla.compiled import compiled_memory  # noqa: E402
from side_by_side import lm_step_problem, time_side_by_side  # noqa: E402


class Block(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads, deterministic=True, use_bias=False)(
            h, mask=nn.make_causal_mask(x[..., 0]))
        h = nn.Dense(4 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(h)), None


class Transformer(nn.Module):
    vocab: int
    dim: int
    heads: int
    layers: int
    scanned: bool

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        if self.scanned:
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
            x, _ = stack(self.dim, self.heads, name="layers")(x, None)
        else:
            for i in range(self.layers):
                x, _ = Block(self.dim, self.heads, name=f"layers_{i}")(x, None)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def problem(layers: int, scanned: bool, dim: int = 64, seq: int = 16, batch: int = 16, vocab: int = 128):
    """(train_step, (params, opt_state, x, y)) of the transformer with optax Adam."""
    return lm_step_problem(Transformer(vocab, dim, 4, layers, scanned), optax.adam(1e-3), batch, seq, vocab)


VERIFY = {}   # --verify N: the searches' SearchOptions.verify (default: the record's)


def _search(step_fn, args, mesh, profiler: str = "measure", max_combinations: int = 4):
    gpu = "H100-SXM" if profiler == "estimate" else None
    return cfp.autoshard(step_fn, mesh, *args, iters=3, max_combinations=max_combinations, profiler=profiler, gpu=gpu,
                         **VERIFY)


def plans(layers: int, rounds: int, mesh, profiler: str = "measure", max_combinations: int = 4) -> None:
    steps, args_of = {}, {}
    for scanned in (True, False):
        name = "scanned" if scanned else "unrolled"
        step_fn, args = problem(layers, scanned)
        t0 = time.perf_counter()
        s = _search(step_fn, args, mesh, profiler, max_combinations)
        a = s.analysis
        print(f"{name} ({layers} layers): {len(a.blocks)} blocks, {len(a.segments)} segments "
              f"({a.num_unique_segments} unique, repeats {[seg.repeat for seg in a.segments]}), "
              f"{len(a.graph.opaque_operators)} opaque operators; cfp plan {list(s.shardings.choice)}"
              + (f" (the {s.search.baseline} baseline)" if s.search.baseline else "")
              + f"; autoshard {time.perf_counter() - t0:.1f} s (measured)")
        uniform = data_parallel_choice(a.graph, a.blocks)
        steps[f"{name} cfp"] = s
        steps[f"{name} data parallel"] = apply_choice(s.program, a, uniform, mesh)
        if scanned:
            steps[f"{name} FSDP"] = apply_choice(s.program, a, uniform, mesh, shard_state=True)
        for k in steps:
            args_of.setdefault(k, args)
    timed = time_side_by_side(steps, args_of, rounds)
    print(f"side by side, {rounds} interleaved rounds (measured, median ± half the range):")
    for k, (t, noise) in timed.items():
        mem = compiled_memory(steps[k].compile(*args_of[k]))
        print(f"  {k:24s} {t * 1e3:8.3f} ms ±{noise * 100:.0f}%  {fmt_bytes(mem)} per device (compiled)")
    sc, un = timed["scanned cfp"][0], timed["unrolled cfp"][0]
    sdp, udp = timed["scanned data parallel"][0], timed["unrolled data parallel"][0]
    print(f"scanned cfp plan vs unrolled twin's cfp plan: {un / sc:.3f}x the speed (measured; >= 0.95 meets "
          f"the target)")
    print(f"speed-up over each model's own data parallel (measured): scanned {sdp / sc:.3f}x, "
          f"unrolled {udp / un:.3f}x")


def scaling(depths: list[int], mesh, profiler: str, runs: int = 2, max_combinations: int = 4,
            warm_up: bool = True) -> None:
    print(f"analysis + search time of the scanned model (dim 32, seq 8, batch 16) at {depths} layers, "
          f"{profiler} profiler:")
    problems = {n: problem(n, True, dim=32, seq=8, batch=16, vocab=64) for n in depths}
    if warm_up:   # JAX's own first-use costs are not the search's (the plans' searches, when run, paid them)
        _search(*problems[depths[0]], mesh, profiler, max_combinations)
    best: dict[int, tuple] = {}
    for _ in range(runs):
        for n in depths:
            t0 = time.perf_counter()
            s = _search(*problems[n], mesh, profiler, max_combinations)
            total = time.perf_counter() - t0
            parts = (s.analysis.analysis_time, s.profile.profile_time, s.search.search_time, total)
            if n not in best or total < best[n][-1]:
                best[n] = parts + (len(s.analysis.blocks),)
    for n in depths:
        a, p, srch, total, blocks = best[n]
        print(f"  {n:3d} layers: {blocks} blocks; analysis {a:.2f} s, profiling {p:.2f} s, search {srch:.2f} s, "
              f"autoshard total {total:.2f} s (measured, fastest of {runs} runs)")
    lo, hi = best[depths[0]], best[depths[-1]]
    print(f"{depths[-1]} vs {depths[0]} layers (measured): autoshard total (analysis + profiling + search) "
          f"{hi[3] / lo[3]:.2f}x, analysis + profiling + search {sum(hi[:3]) / sum(lo[:3]):.2f}x, "
          f"analysis + search {(hi[0] + hi[2]) / (lo[0] + lo[2]):.2f}x (target <= 1.5x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="layers of the scanned/unrolled pair")
    p.add_argument("--scaling", default="2,64", help="comma-separated layer counts for the timing (scanned)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--scaling-profiler", choices=("estimate", "measure"), default="measure",
                   help="profiler of the scaling runs (measure: runs every candidate; estimate: compiles only)")
    p.add_argument("--profiler", choices=("measure", "estimate"), default="measure",
                   help="profiler of the plans' searches (estimate: the H100-SXM cost model; the plans are then "
                        "timed side by side all the same)")
    p.add_argument("--skip-plans", action="store_true")
    p.add_argument("--scaling-runs", type=int, default=2, help="searches per depth in the scaling (the fastest counts)")
    p.add_argument("--max-combinations", type=int, default=4, help="profiled combinations per segment (every search)")
    p.add_argument("--verify", type=int, default=None,
                   help="whole-step plans each search compiles and times (default: cfp.SearchOptions's)")
    a = p.parse_args()
    if a.verify is not None:
        VERIFY["verify"] = a.verify
    try:
        depths = [int(n) for n in a.scaling.split(",") if n]
    except ValueError:
        raise SystemExit(f"scan_vs_unrolled: --scaling {a.scaling!r} must be comma-separated layer counts") from None
    if a.layers < 1 or a.rounds < 3 or any(n < 1 for n in depths) or a.scaling_runs < 1 or a.max_combinations < 1:
        raise SystemExit("scan_vs_unrolled: --layers, every --scaling count, --scaling-runs and --max-combinations "
                         "must be >= 1, --rounds >= 3")
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, mesh 2x4")
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    if not a.skip_plans:
        plans(a.layers, a.rounds, mesh, a.profiler, a.max_combinations)
    if depths:
        scaling(depths, mesh, a.scaling_profiler, a.scaling_runs, a.max_combinations, warm_up=a.skip_plans)


if __name__ == "__main__":
    main()
