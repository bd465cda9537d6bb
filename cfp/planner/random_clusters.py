"""Random small clusters and the planner-vs-exhaustive comparison on them, shared by the property tests
(`tests/test_planner.py`) and the optimality sweep (`benchmarks/planner_optimality.py`).

A seed fixes everything: the cluster (machines of 1, 2, 4 or 8 devices of the papers' GPU types, PCIe
or NVLink inside, 1.25 or 12.5 GB/s between), the model (a 2048-wide Llama of 4 or 6 layers, whose
0.8 GB of AdamW state per layer fits any of these devices) and the options (8 sequences per step,
micro-batches of 1 or 2)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

from cfp.errors import InfeasibleError
from cfp.models import get_config
from cfp.planner.cluster import Cluster, parse_cluster
from cfp.layout import Layout
from cfp.planner.costmodel import CostModel, Estimate
from cfp.planner.exhaustive import exhaustive_layout
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import PlannerResult, find_layout

GPUS = ("RTX3080Ti", "RTX3090", "RTX4090", "A100-PCIe-40G", "A100-SXM-80G", "L4")


def random_cluster(rng: random.Random, max_devices: int) -> Cluster:
    """Machines drawn until `max_devices` or a 40% chance of stopping after each."""
    machines, total = [], 0
    while not machines or (total < max_devices and rng.random() < 0.6):
        count = rng.choice([c for c in (1, 2, 4, 8) if total + c <= max_devices] or [1])
        machines.append({"gpu": rng.choice(GPUS), "count": count,
                         "intra_bandwidth": f"{rng.choice([16, 25, 300])}GB/s"})
        total += count
    return parse_cluster({"inter_machine_bandwidth": f"{rng.choice([1.25, 12.5])}GB/s", "machines": machines})


@dataclass(frozen=True)
class OptimalityCase:
    """The planner's result and the exhaustive optimum (None: the search passed its layout cap) on the
    random cluster of `seed`; both are estimates of the same cost model."""
    seed: int
    cluster: Cluster
    config: Any
    options: PlannerOptions
    planned: PlannerResult
    optimum: Optional[tuple[Layout, Estimate, int]]   # layout, estimate, layouts estimated

    @property
    def gap(self) -> Optional[float]:
        """Planner's estimated step time over the optimum's, minus one."""
        if self.optimum is None:
            return None
        return self.planned.estimate.step_time / self.optimum[1].step_time - 1


def optimality_case(seed: int, max_devices: int = 6, limit: int = 200_000) -> OptimalityCase:
    rng = random.Random(seed)
    cluster = random_cluster(rng, max_devices)
    cfg = get_config("llama2", "7B", dtype="bfloat16", num_layers=rng.choice([4, 6]), seq_len=1024,
                     hidden_size=2048, num_heads=16, ffn_size=5504)
    options = PlannerOptions(global_batch_size=8, micro_batch_sizes=(1, 2))
    planned = find_layout(cluster, cfg, options)
    try:
        optimum = exhaustive_layout(CostModel(cfg, cluster, options.schedule), options, limit)
    except InfeasibleError as e:
        if "passed" not in str(e):
            raise
        optimum = None
    return OptimalityCase(seed, cluster, cfg, options, planned, optimum)
