"""Which dim of the MoE expert weights should take the tensor-parallel axes: the experts ("exp") or the
feed-forward size ("mlp")? Times one tiny MoE train step both ways, side by side, on 8 CPU devices.

    python benchmarks/moe_wi.py [--config tiny] [--batch-size 16] [--iters 20] [--meshes 4,2x4]

Every parameter not under `moe` gets the same spec in both variants (the `cfp.sharding.rules` table); only
`moe/wi` and `moe/wo` (and their optimizer state) differ. Meshes: "4" (megatron-tp over 4 devices, as a
pipeline stage with TP 4) and "2x4" (dp-tp). The two variants run round-robin (one warm-up each, then `--iters`
rounds) and the median step time is printed (measured, wall clock), with per-device memory of the compiled step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from cfp.baselines.handwritten import baseline_specs  # noqa: E402
from cfp.mesh import MeshSpec  # noqa: E402
from cfp.models import get_config, train_step  # noqa: E402
from cfp.sharding.rules import TENSOR_RULES, path_keys, tensor_spec  # noqa: E402
from cfp.xla.compiled import compiled_memory  # noqa: E402

ORDERS = {
    "exp (experts)": TENSOR_RULES,
    "mlp (ffn)": tuple(r for r in TENSOR_RULES if r.dim != "exp") + tuple(r for r in TENSOR_RULES if r.dim == "exp"),
}


def variant(args, mesh, baseline, rules):
    names, sizes = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    tp_axes = names[-1] if len(names) == 1 or baseline == "dp-tp" else names
    tp = sizes[-1]
    specs = baseline_specs(baseline, args, mesh)

    def fix(path, spec, x):
        keys = path_keys(path)
        if "moe" in keys and keys[-1] in ("wi", "wo"):
            return tensor_spec(keys, x.shape, tp_axes, tp, rules=rules)
        return spec
    specs = tuple(jax.tree_util.tree_map_with_path(fix, s, a, is_leaf=lambda v: isinstance(v, P))
                  for s, a in zip(specs[:2], args[:2])) + (specs[2],)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda v: isinstance(v, P))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--meshes", default="4,2x4", help="which of the meshes 4 (megatron-tp) and 2x4 (dp-tp) to time")
    a = p.parse_args()
    meshes = tuple(m for m in (("4", "megatron-tp"), ("2x4", "dp-tp")) if m[0] in a.meshes.split(","))
    if not meshes or len(meshes) != len(a.meshes.split(",")):
        raise SystemExit(f"moe_wi: --meshes {a.meshes!r} must name some of 4, 2x4 (comma-separated)")
    ts = train_step("moe", get_config("moe", a.config))
    params, opt = ts.init(0)
    args = (params, opt, ts.make_batch(a.batch_size, 0))
    ref = float(jax.jit(ts.step)(*args)[2])
    for mesh_text, baseline in meshes:
        mesh = MeshSpec.parse(mesh_text).make()
        runs = {}
        for name, rules in ORDERS.items():
            sh = variant(args, mesh, baseline, rules)
            step = jax.jit(ts.step, in_shardings=sh, out_shardings=(sh[0], sh[1], NamedSharding(mesh, P())))
            placed = jax.device_put(args, sh)
            compiled = step.lower(*placed).compile()
            loss = float(compiled(*placed)[2])
            if abs(loss - ref) > 1e-4 * abs(ref):
                raise SystemExit(f"{name}: loss {loss} differs from the unsharded {ref}")
            wi = sh[0]["params"]["layers_1"]["moe"]["wi"].spec
            runs[name] = (compiled, placed, compiled_memory(compiled), wi, [])
        for _ in range(a.iters + 1):          # round-robin; the first round is the warm-up
            for name, (compiled, placed, _, _, times) in runs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(*placed))
                times.append(time.perf_counter() - t0)
        print(f"mesh {mesh_text} ({baseline}), moe {a.config}, batch {a.batch_size}, {a.iters} rounds:")
        for name, (_, _, mem, wi, times) in runs.items():
            print(f"  wi on {name:14s} wi spec {str(wi):28s} median step {statistics.median(times[1:]) * 1e3:8.2f} ms "
                  f"(measured)  memory {mem / 1e6:.2f} MB per device (compiled)")


if __name__ == "__main__":
    main()
