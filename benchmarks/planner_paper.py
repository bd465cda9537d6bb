"""The planner's estimated MFU on HexiScale's clusters (`examples/clusters/`) next to the MFU HexiScale's
README reports (measured on its testbed; source: HexiScale README, "Performance Results", arXiv 2409.01143).

Llama in bfloat16, 1F1B, global batch 4 sequences per device, the configs' sequence lengths. Our MFU is
given against the catalog's dense BF16 peaks (`cfp.hardware.gpus`) and against HexiScale's peak table
(TFLOP/s: 3080 Ti 56.9, 3090 80, 4090 165.2, A100 312), which differs for the 3080 Ti and 3090; the
Megatron-style column is the best uniform (TP, PP, DP) layout under the same cost model. The planner prices the
attention cfp's runtime chooses on the cluster's GPUs (`cfp.models.attention_select`: cuDNN's fused attention for
bfloat16 causal rows on Ampere and later, which every cluster here is; the "attention" column), as HexiScale runs
flash-attn 2 (its README's environment); the "materialised" column re-prices the planner's layout with float32
scores written to memory (`StepFeatures(fused_attention=False)`, what the planner priced before the runtime chose
fused attention), everything else unchanged. All our figures are estimates.

    PYTHONPATH=$PWD python benchmarks/planner_paper.py [--rows N]
"""
from __future__ import annotations

import argparse

import yaml

from cfp.models import get_config
from cfp.planner.baselines import megatron_layout
from cfp.planner.cluster import parse_cluster
from cfp.planner.costmodel import CostModel
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import find_layout
from cfp.planner.step_features import StepFeatures, runtime_fuses_attention

HEXISCALE_PEAKS = {"RTX3080Ti": 56.9, "RTX3090": 80.0, "RTX4090": 165.2, "A100-SXM-80G": 312.0,
                   "A100-PCIe-80G": 312.0}
# (cluster file, Llama config, HexiScale's reported MFU: HexiScale on the mixed clusters, Megatron on
# the homogeneous ones)
ROWS = (("paper-llama2-a.yaml", "7B", 31.19), ("paper-llama2-a.yaml", "13B", 27.23),
        ("paper-llama2-b.yaml", "7B", 33.47), ("paper-llama2-b.yaml", "13B", 31.39),
        ("paper-llama-30b.yaml", "30B", 27.49),
        ("megatron-2x8-a100-pcie.yaml", "7B", 38.58), ("megatron-2x8-a100-pcie.yaml", "13B", 39.46),
        ("megatron-4x8-a100-pcie.yaml", "30B", 27.79))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=len(ROWS), help="the first N rows of the table only")
    args = ap.parse_args()
    if not 1 <= args.rows <= len(ROWS):
        raise SystemExit(f"planner_paper: --rows {args.rows} must be 1..{len(ROWS)}")
    print(f"{'cluster':<28} {'model':>5} {'ours (catalog)':>15} {'ours (HexiScale peaks)':>23} "
          f"{'attention':>9} {'materialised':>12} {'Megatron-style':>15} {'reported':>9} {'planning':>9}")
    for path, name, reported in ROWS[:args.rows]:
        with open(f"examples/clusters/{path}") as f:
            cluster = parse_cluster(yaml.safe_load(f))
        cfg = get_config("llama2", name, dtype="bfloat16")
        options = PlannerOptions(global_batch_size=4 * cluster.num_devices)
        r = find_layout(cluster, cfg, options)
        cm = CostModel(cfg, cluster, options.schedule)
        hexi = cm.mfu_with_peaks(r.estimate, r.layout, HEXISCALE_PEAKS)
        scores = CostModel(cfg, cluster, options.schedule, features=StepFeatures(fused_attention=False))
        attention = "fused" if runtime_fuses_attention(cfg, cluster) else "scores"
        mega = megatron_layout(cm, options)
        mega_s = "no layout fits" if mega is None else f"{100 * mega[1].mfu:.2f}%"
        print(f"{path:<28} {name:>5} {100 * r.estimate.mfu:>14.2f}% {100 * hexi:>22.2f}% "
              f"{attention:>9} {100 * scores.estimate(r.layout).mfu:>11.2f}% {mega_s:>15} "
              f"{reported:>8.2f}% {r.seconds:>7.2f} s", flush=True)
    print("ours: estimated; reported: measured by HexiScale; planning: measured")


if __name__ == "__main__":
    main()
