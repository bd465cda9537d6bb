"""A rematerialised transformer (Flax `nn.remat` per layer) vs its plain twin on 8 simulated CPU devices:
analysis and search, plan speed side by side, and compiled memory with and without remat.

    python benchmarks/remat.py [--layers 4] [--batch 32] [--rounds 10] [--policy nothing_saveable]
                               [--profiler measure|estimate --gpu A100-SXM-80G] [--verify N]

Both twins are searched by cfp (measure profiler unless --profiler estimate, 2x4 mesh). Then, timed in turns
(interleaved rounds, so a burst of load on a shared host lands on all alike): the remat model under its own
cfp plan, under its plain twin's cfp plan (the twins analyse to the same blocks, so the choice carries over),
and under data parallelism; the plain model under its cfp plan and data parallelism. Memory is XLA's compiled
per-device figure (arguments + outputs + temporaries, and temporaries alone): remat should keep its saving
under cfp's plans as it does under `jax.jit` on one device.
"""
import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import cfp  # noqa: E402
from cfp.analysis.blocks import DotRole, data_parallel_choice  # noqa: E402
from cfp.search.options import fmt_bytes  # noqa: E402
from cfp.sharding.step import apply_choice  # noqa: E402
from cfp.xla.compiled import compiled_memory  # noqa: E402
from side_by_side import lm_step_problem, time_side_by_side  # noqa: E402

VOCAB, DIM, SEQ, HEADS = 256, 64, 32, 4
POLICIES = ("default", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(HEADS, deterministic=True, use_bias=False)(
            h, mask=nn.make_causal_mask(x[..., 0]))
        h = nn.Dense(4 * DIM)(nn.LayerNorm()(x))
        return x + nn.Dense(DIM)(nn.gelu(h))


class Transformer(nn.Module):
    layers: int
    remat: bool
    policy: str

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM)(tokens)
        policy = None if self.policy == "default" else getattr(jax.checkpoint_policies, self.policy)
        block = nn.remat(Block, policy=policy) if self.remat else Block
        for i in range(self.layers):
            x = block(name=f"layers_{i}")(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def problem(layers: int, batch: int, remat: bool, policy: str):
    return lm_step_problem(Transformer(layers, remat, policy), optax.adam(1e-3), batch, SEQ, VOCAB)


def _temp(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def search(label, step, args, mesh, profiler="measure", gpu=None, max_combinations=4, verify=None):
    t0 = time.perf_counter()
    searched = cfp.autoshard(step, mesh, *args, iters=3, max_combinations=max_combinations, profiler=profiler, gpu=gpu,
                             verify=verify)
    wall = time.perf_counter() - t0
    a = searched.analysis
    recomputed = sum(d.role is DotRole.RECOMPUTE for b in a.blocks for d in b.dots)
    print(f"  {label}: {len(a.blocks)} blocks ({recomputed} recomputed dots paired), {len(a.segments)} segments "
          f"of {a.num_unique_segments} kinds, largest {max(s.stop - s.start for s in a.segments)} blocks; "
          f"autoshard {wall:.1f} s (measured), {searched.profile.compiles} profiling compiles; plan "
          + (f"= the {searched.search.baseline} baseline" if searched.search.baseline else "searched"))
    return searched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--policy", default="default", help=f"one of {', '.join(POLICIES)}")
    p.add_argument("--profiler", choices=("measure", "estimate"), default="measure",
                   help="how cfp's search ranks plans (estimate: the cost model of --gpu)")
    p.add_argument("--gpu", default=None, help="catalog GPU of --profiler estimate")
    p.add_argument("--max-combinations", type=int, default=4, help="profiled combinations per segment")
    p.add_argument("--verify", type=int, default=None,
                   help="whole-step plans each search compiles and times (default: cfp.SearchOptions's)")
    a = p.parse_args()
    if (a.layers < 1 or a.batch < 8 or a.batch % 8 or a.rounds < 3 or a.policy not in POLICIES
            or a.max_combinations < 1 or (a.verify or 0) < 0):
        raise SystemExit(f"remat: --layers >= 1, --batch a multiple of 8, --rounds >= 3, --policy one of "
                         f"{', '.join(POLICIES)}, --max-combinations >= 1, --verify >= 0 (got {a.layers}, {a.batch}, "
                         f"{a.rounds}, {a.policy!r}, {a.max_combinations}, {a.verify})")
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, mesh 2x4; "
          f"{a.layers}-layer transformer, batch {a.batch}, remat policy {a.policy}")
    plain_step, args = problem(a.layers, a.batch, False, a.policy)
    remat_step, _ = problem(a.layers, a.batch, True, a.policy)
    print("search:")
    plain = search("plain", plain_step, args, mesh, a.profiler, a.gpu, a.max_combinations, a.verify)
    remat = search("remat", remat_step, args, mesh, a.profiler, a.gpu, a.max_combinations, a.verify)
    ra, rp = remat.analysis, remat.program
    steps = {
        "remat, cfp plan": remat,
        "remat, plain twin's plan": apply_choice(rp, ra, plain.shardings.choice, mesh, plain.shardings.shard_state),
        "remat, data parallel": apply_choice(rp, ra, data_parallel_choice(ra.graph, ra.blocks), mesh),
        "plain, cfp plan": plain,
        "plain, data parallel": apply_choice(plain.program, plain.analysis,
                                             data_parallel_choice(plain.analysis.graph, plain.analysis.blocks), mesh),
    }
    timed = time_side_by_side(steps, args, a.rounds)
    dp = timed["plain, data parallel"][0]
    print(f"plans, timed in turns ({a.rounds} rounds; the same program timed twice differs by noise):")
    for k, s in steps.items():
        t, noise = timed[k]
        c = s.compile(*args)
        print(f"  {k:26s} {t * 1e3:8.2f} ms ±{noise * 100:.0f}% (measured), {dp / t:.2f}x plain data parallel; "
              f"{fmt_bytes(compiled_memory(c))} per device, {fmt_bytes(_temp(c))} temporaries (compiled)")
    print("one device, jax.jit as written (compiled):")
    for label, fn in (("plain", plain_step), ("remat", remat_step)):
        c = jax.jit(fn).lower(*args).compile()
        print(f"  {label}: {fmt_bytes(compiled_memory(c))}, {fmt_bytes(_temp(c))} temporaries")


if __name__ == "__main__":
    main()
