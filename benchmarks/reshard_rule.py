"""Check `cfp.sharding.reshard`'s rule against XLA on every pair of tensor layouts.

    .venv/bin/python benchmarks/reshard_rule.py [--partitioner shardy|gspmd] [--meshes 2x4 4x2 8] [--max-rank 4]

For every pair of layouts of rank-2 and rank-3 tensors (16 per dim) on 2x4, 4x2 and 8 meshes and of rank-4
tensors on 2x4, it compiles the move from one to the other and reads XLA's log for an involuntary full
rematerialization. It prints how many moves XLA rematerialized, how many of those `direct_ok` called efficient
(missed: should be 0), how many it flagged that XLA did manage, and how many flagged moves still rematerialize
along `reshard_path` (should be 0). All figures are measured on the local XLA; prints figures, asserts nothing.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cfp.cli.common import ensure_host_devices  # noqa: E402

SWEEP = (("2x4", (2, 3, 4)), ("4x2", (2, 3)), ("8", (2, 3)))


def rematerializations(mesh_spec, src, path, shape) -> tuple:
    """XLA's involuntary full rematerializations compiling x -> `src` -> each layout of `path` in turn."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from cfp.sharding.specs import partition_spec
    from cfp.xla.log import capture_log
    mesh = mesh_spec.make()

    def sharding(spec):
        return NamedSharding(mesh, partition_spec(spec, mesh_spec.axis_names))

    def f(a):
        a = jax.lax.with_sharding_constraint(a * 2, sharding(src))
        for spec in path:
            a = jax.lax.with_sharding_constraint(a, sharding(spec))
        return a * 3

    fn = jax.jit(f, in_shardings=sharding(src), out_shardings=sharding(path[-1]))
    with capture_log() as log:
        fn.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile()
    return log.rematerializations


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--partitioner", choices=("shardy", "gspmd"), default="shardy")
    p.add_argument("--meshes", nargs="+", choices=[m for m, _ in SWEEP], default=[m for m, _ in SWEEP],
                   help="meshes of the sweep (default: all)")
    p.add_argument("--max-rank", type=int, choices=(2, 3, 4), default=4, help="largest tensor rank swept")
    args = p.parse_args(argv)
    ensure_host_devices()
    import jax

    from cfp.mesh import MeshSpec
    from cfp.sharding.reshard import all_layouts, direct_ok, reshard_path
    jax.config.update("jax_use_shardy_partitioner", args.partitioner == "shardy")
    pairs = remat = missed = flagged = dirty = 0
    for mesh_text, ranks in SWEEP:
        if mesh_text not in args.meshes:
            continue
        mesh_spec = MeshSpec.parse(mesh_text)
        for rank in (r for r in ranks if r <= args.max_rank):
            shape = (16,) * rank
            for src, dst in itertools.permutations(all_layouts(rank, len(mesh_spec.shape)), 2):
                pairs += 1
                found = bool(rematerializations(mesh_spec, src, [dst], shape))
                remat += found
                if not direct_ok(src, dst):
                    flagged += 1
                    path = reshard_path(src, dst, shape, mesh_spec.shape)
                    dirty += bool(rematerializations(mesh_spec, src, list(path), shape))
                elif found:
                    missed += 1
                    print(f"missed: {mesh_text} rank {rank} {src} -> {dst}")
    print(f"jax {jax.__version__}, {args.partitioner}: {pairs} layout pairs, measured: XLA rematerialized {remat}; "
          f"direct_ok missed {missed}, flagged {flagged} ({flagged - remat + missed} of them XLA managed); "
          f"flagged moves still rematerializing along reshard_path: {dirty}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
