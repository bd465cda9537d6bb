"""Every schedule with and without recomputation, side by side in one process (issue 38): measured tokens/s on
this host's shared cores (where wall time is the total work: what recomputation costs shows, a bubble does not),
the same tokens per CPU second of the process (its work, which other load on the host does not inflate as it does
wall time), and the makespan simulated from each stage's median F/B/W measured one action at a time after the timed
steps (every stage owning its compute: what a bubble costs shows), each run verified against one device.

    python benchmarks/compute_once.py                          # the uneven 4-stage Llama-2 layout, 6 steps
    python benchmarks/compute_once.py --config small --schedules 1f1b   # the same at hidden 256
    python benchmarks/compute_once.py --steps 3 --num-layers 4 --layer-partitions "[[1,1,1,1]]" --chunks 4 \\
        --schedules 1f1b zb-h1 --recompute none full           # shrunk
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEDULES = ("gpipe", "1f1b", "interleaved:2", "zb-h1", "zb-v")


def run(schedule: str, recompute: str, args) -> dict:
    from cfp.cli.train import parse_nested_list
    from cfp.layout import Layout
    from cfp.runtime.training import TrainOptions, run_training
    layout = Layout.from_lists(parse_nested_list(args.hetero_configs, "hetero_configs"),
                               parse_nested_list(args.layer_partitions, "layer_partitions"),
                               global_batch_size=args.global_batch_size, chunks=args.chunks)
    opts = TrainOptions(model="llama2", config_name=args.config, layout=layout,
                        overrides={"num_layers": args.num_layers},
                        schedule=schedule, steps=args.steps, verify=True, recompute=recompute,
                        )
    r = run_training(opts, log=lambda *a, **k: None)
    if not r.verify_ok:
        raise SystemExit(f"{schedule} recompute {recompute}: verify failed ({r.verify_error})")
    return {"tokens_per_s": r.tokens_per_s, "tokens_per_cpu_s": r.tokens_per_cpu_s,
            "makespan": r.median_makespan.get(0), "error": r.verify_error}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="the Llama-2 config (tiny: the issue's layout; small: hidden "
                    "256, where the dots outweigh XLA's per-operation costs on a CPU)")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hetero-configs", default="[[1,1,1,1]]")
    ap.add_argument("--layer-partitions", default="[[3,2,2,1]]")
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--recompute", nargs="+", default=["none", "full"], choices=["none", "selective", "full"])
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds over every run, in alternating order (each run's median over them is reported)")
    args = ap.parse_args(argv)
    runs = [(s, rc) for s in args.schedules for rc in args.recompute]
    run(*runs[0], args)          # a first run warms this process (imports, caches), left out of the figures
    got: dict = {r: [] for r in runs}
    print(f"{'schedule':<14} {'recompute':<10} {'tokens/s (measured)':>20} {'per CPU second (measured)':>26} "
          f"{'makespan (simulated)':>21} {'verify error':>13}  (median of {args.rounds} rounds)")
    for k in range(args.rounds):
        for r in (runs if k % 2 == 0 else runs[::-1]):
            got[r].append(run(*r, args))
    rows = {}
    for (schedule, rc), rs in got.items():
        med = lambda key: statistics.median(x[key] for x in rs)
        r = rows[(schedule, rc)] = {"tokens_per_s": med("tokens_per_s"), "tokens_per_cpu_s": med("tokens_per_cpu_s"),
                                    "makespan": med("makespan"), "error": max(x["error"] for x in rs)}
        print(f"{schedule:<14} {rc:<10} {r['tokens_per_s']:>20,.0f} {r['tokens_per_cpu_s']:>26,.0f} "
              f"{r['makespan']:>19.4f} s {r['error']:>13.2e}", flush=True)
    _ratios(rows)
    return 0


def _ratios(rows: dict) -> None:
    """The issue's comparisons, where the runs are there: measured tokens/s ratios and simulated makespan ratios."""
    def ratio(a, b, key):
        return rows[a][key] / rows[b][key] if a in rows and b in rows else None
    lines = [("1f1b none / 1f1b full tokens/s (measured)", ratio(("1f1b", "none"), ("1f1b", "full"), "tokens_per_s")),
             ("1f1b none / 1f1b full tokens per CPU second (measured)",
              ratio(("1f1b", "none"), ("1f1b", "full"), "tokens_per_cpu_s")),
             ("zb-h1 none / 1f1b none tokens/s (measured)", ratio(("zb-h1", "none"), ("1f1b", "none"), "tokens_per_s")),
             ("zb-h1 none / 1f1b none tokens per CPU second (measured)",
              ratio(("zb-h1", "none"), ("1f1b", "none"), "tokens_per_cpu_s"))]
    for s in ("zb-h1", "zb-v", "interleaved:2", "gpipe"):
        lines.append((f"{s} / 1f1b makespan, none (simulated from measured medians)",
                      ratio((s, "none"), ("1f1b", "none"), "makespan")))
    for name, value in lines:
        if value is not None:
            print(f"{name}: {value:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
