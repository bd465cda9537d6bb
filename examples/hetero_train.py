"""Heterogeneous hybrid 3D-parallel training (FlashFlex/HexiScale layouts) on 8 simulated CPU devices.

Runs a few layouts of a tiny Llama-2 on byte-level Python-stdlib text, prints tokens/s and the measured
vs theoretical pipeline bubble, checks one layout against a single device, and writes a timeline.

    python examples/hetero_train.py [--steps 6] [--out /tmp/hetero] [--layouts 1 3]

The same from the command line::

    cfp train --model llama2 --num-layers 4 --hetero-configs "[[2,1,1],[4]]" \\
        --layer-partitions "[[2,1,1],[4]]" --global-batch-size 6 2 --chunks 3 1 \\
        --schedule 1f1b --steps 5 --verify --timeline-dir /tmp/tl

Multi-process on one host (2 processes x 4 devices, gloo collectives on 127.0.0.1)::

    cfp launch --nprocs 2 --devices-per-proc 4 -- cfp train --model llama2 --num-layers 3 \\
        --hetero-configs "[[2,1,1],[2,1,1]]" --layer-partitions "[[1,1,1],[1,1,1]]" \\
        --devices-id "[[[0,1],[4],[2]],[[5,6],[3],[7]]]" --global-batch-size 6 2 --chunks 3 1

Multi-host: start one ``cfp launch`` per host with ``--coordinator HOST0:PORT --num-processes N
--first-rank R`` (or set CFP_COORDINATOR / CFP_NUM_PROCESSES / CFP_PROCESS_ID / CFP_DEVICES_PER_PROC
per process).  Every process builds the same plan from the same arguments; device ids in
``--devices-id`` index ``jax.devices()`` (process 0's devices first), and each stage's devices must
belong to one process.  Stages talk through XLA collectives on 2-device meshes (gloo on CPU, NCCL on
GPU), so the coordinator port and the gloo/NCCL ports must be reachable between hosts.  A process that
dies makes its peers' next transfer fail (or JAX's heartbeat time out), ending the job with an error.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

LAYOUTS = [  # name, hetero_configs, layer_partitions, global batch sizes, chunks
    ("1 pipeline x 8 stages (TP1)", [[1] * 8], [[1] * 8], [16], [8]),
    ("2-1-1 + 4 (hetero)", [[2, 1, 1], [4]], [[4, 2, 2], [8]], [12, 4], [6, 2]),
    ("4 + 2 + 1 + 1 (DP only)", [[4], [2], [1], [1]], [[8], [8], [8], [8]], [8, 4, 2, 2], [1]),
    ("2 pipelines x 4 stages", [[1, 1, 1, 1], [1, 1, 1, 1]], [[2, 2, 2, 2]] * 2, [8, 8], [4, 4]),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    ap.add_argument("--out", default="/tmp/cfp-hetero")
    ap.add_argument("--layouts", type=int, nargs="+", default=list(range(len(LAYOUTS))),
                    choices=range(len(LAYOUTS)), metavar="I", help="run only these layouts (0-based; default all)")
    args = ap.parse_args()

    from cfp.layout import Layout
    from cfp.schedules.registry import ScheduleName
    from cfp.runtime.timeline import theoretical_bubble
    from cfp.runtime.training import DataSource, TrainOptions, run_training

    rows = []
    for i, (name, tps, parts, gbs, chunks) in enumerate(LAYOUTS):
        if i not in args.layouts:
            continue
        layout = Layout.from_lists(tps, parts, gbs, chunks)
        opts = TrainOptions(model="llama2", layout=layout, overrides=dict(num_layers=8, seq_len=64),
                            schedule=ScheduleName(args.schedule), steps=args.steps,
                            data=DataSource.STDLIB, verify=(i == 1),
                            timeline_dir=os.path.join(args.out, f"layout{i}"))
        print(f"== {name}")
        res = run_training(opts, log=lambda *a, **k: None)
        b = res.bubbles.get(0, {})
        rows.append((name, _figure(res.tokens_per_s, ",.0f"), _figure(b.get("bubble"), ".1%"),
                     format(theoretical_bubble(len(tps[0]), chunks[0]), ".1%"), res.verify_error))
        print(f"   tokens/s {rows[-1][1]} (measured); pipeline 0 bubble {rows[-1][2]} (measured; theory "
              f"{rows[-1][3]})" + (f"; verify error {res.verify_error:.2e}" if res.verify_error is not None else ""))
    print("\nlayout                          tokens/s   bubble  theory   (measured, measured, equal-time formula)")
    for name, tps, bub, theo, _ in rows:
        print(f"{name:30s} {tps:>9s} {bub:>8s} {theo:>7s}")
    print(f"timelines (JSON + PNG) under {args.out}/layout*/")
    return 0 if all(r[4] is None or r[4] < 1e-4 for r in rows) else 1


def _figure(value, fmt: str) -> str:
    """A measured figure, or "n/a" where the run measured none (a single, tracing step gives no rate; a step the
    host was too busy to watch in full gives no bubble)."""
    return "n/a" if value is None else format(value, fmt)


if __name__ == "__main__":
    sys.exit(main())
