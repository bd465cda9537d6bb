"""Per-block cost-model figures of a plan: what each block costs under its strategy and what the runner-up would.

Every figure is an estimate of the `cfp.profiling.gpu_estimate` analytic model on a catalog GPU (dots by dtype,
precision and per-device GEMM shape; the block's predicted collectives over the GPU's link), per device and
per step; memory is the per-device bytes of the tensors the block's layout places (weights, optimizer state and
activations alike), not a compiled figure.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from cfp.analysis.analysis import Analysis
from cfp.analysis.block_sharding import block_layout, shards
from cfp.errors import ConfigError
from cfp.hardware import rates
from cfp.hardware.gpus import GpuSpec
from cfp.profiling import gpu_estimate


@dataclasses.dataclass(frozen=True)
class BlockFigures:
    """One block of a plan: where it is, its strategy and its estimated cost; the runner-up and the difference."""

    block: int
    scope: str
    segment: int
    strategy: str
    compute_s: float
    comm_s: float
    memory_bytes: int
    runner_up: str | None = None
    runner_up_delta_s: float | None = None     # runner-up minus this block; < 0: the analytic model alone prefers
    #                                           the runner-up (the search also weighs resharding, profiled times)
    repeat: int = 1       # runs per step: a scan body's block has its figures for one iteration, run `repeat` times

    @property
    def time_s(self) -> float:
        """Seconds of one run (one iteration of a scan body's block)."""
        return self.compute_s + self.comm_s

    @property
    def step_time_s(self) -> float:
        """Seconds per step: every run of the block."""
        return self.time_s * self.repeat

    @property
    def step_memory_bytes(self) -> int:
        """Per-device bytes over every run: a scan body's iterations each place their own layer's tensors."""
        return self.memory_bytes * self.repeat

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.repeat == 1:      # outside loops: the plan files written before `repeat` existed, unchanged
            del d["repeat"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BlockFigures":
        if not isinstance(d, dict) or isinstance(d.get("repeat", 1), bool) or not (
                isinstance(d.get("repeat", 1), int) and d.get("repeat", 1) >= 1):
            raise ConfigError(f"block estimate {d!r} is malformed: repeat must be an integer >= 1")
        try:
            return cls(block=int(d["block"]), scope=str(d["scope"]), segment=int(d.get("segment", -1)),
                       strategy=str(d["strategy"]), compute_s=float(d["compute_s"]), comm_s=float(d["comm_s"]),
                       memory_bytes=int(d["memory_bytes"]), runner_up=d.get("runner_up"),
                       runner_up_delta_s=None if d.get("runner_up_delta_s") is None else float(d["runner_up_delta_s"]),
                       repeat=int(d.get("repeat", 1)))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"block estimate {d!r} is malformed: {e}") from None


def block_scope(analysis: Analysis, block: int) -> str:
    """The block's module scope without the root, e.g. `layers_3/mlp/fc_out`."""
    op = analysis.graph.operators[analysis.blocks[block].forward.op]
    parts = list(op.scope)
    if len(parts) > 1:
        parts = parts[1:]
    return "/".join(parts) or f"block_{block}"


def _tensor_runs(analysis: Analysis, tid: int) -> int:
    """How many values of a tensor one step makes: its producer's trip counts (a scan body's tensor, an enter
    port's slice included, has one per iteration); a step input or constant has one."""
    g = analysis.graph
    op = g.producer.get(tid)
    if op is None:
        return 1
    if g.operators[op].primitive == "scan_enter":
        return g.repeat(op) * g.loops[int(g.operators[op].param("loop"))].length
    return g.repeat(op)


def strategy_cost(analysis: Analysis, block: int, strategy: int, gpu: GpuSpec) -> tuple[float, float, int]:
    """(compute seconds, communication seconds, per-device bytes) of one block under one strategy, for one run
    of the block: a scan body's block counts one iteration's tensors and a 1/N share of the stacked tensors
    (all N layers' weights, optimizer state, saved activations) it places, so N runs count them once."""
    g, shape = analysis.graph, analysis.mesh.shape
    mp = gpu_estimate.matmul_precision()
    compute = sum(rates.dot_time(f, gpu, dt, mp, mnk)
                  for f, dt, mnk in gpu_estimate.dot_costs(analysis, [(block, strategy)]))
    lay = block_layout(g, analysis.blocks[block], strategy, shape)
    comm = sum(gpu_estimate.collective_seconds("all-reduce" if c.kind == "all-reduce" else "all-gather", c.bytes,
                                            gpu_estimate.group_size(c.axes, shape), gpu) for c in lay.collectives)
    runs = g.repeat(analysis.blocks[block].forward.op)
    memory = sum(g.tensor(t).nbytes // shards(spec, shape) * _tensor_runs(analysis, t) for t, spec in lay.specs)
    return compute, comm, int(memory // runs)


def plan_figures(analysis: Analysis, choice: Sequence[int], gpu: GpuSpec) -> tuple[BlockFigures, ...]:
    """Figures of every block of `choice`, with each block's best other strategy by the same model."""
    if len(choice) != len(analysis.blocks):
        raise ConfigError(f"choice has {len(choice)} entries, the analysis {len(analysis.blocks)} blocks")
    seg_of = {b: s for s in analysis.segments for b in s.blocks}
    out = []
    for b, chosen in enumerate(choice):
        costs = {s: strategy_cost(analysis, b, s, gpu) for s in range(len(analysis.blocks[b].strategies))}
        own = costs[chosen]
        others = sorted((c[0] + c[1], s) for s, c in costs.items() if s != chosen)
        ru = others[0][1] if others else None
        seg = seg_of.get(b)
        out.append(BlockFigures(block=b, scope=block_scope(analysis, b), segment=seg.index if seg else -1,
                                strategy=analysis.notation(b, chosen), compute_s=own[0], comm_s=own[1],
                                memory_bytes=own[2], runner_up=analysis.notation(b, ru) if ru is not None else None,
                                runner_up_delta_s=others[0][0] - (own[0] + own[1]) if others else None,
                                repeat=seg.repeat if seg else 1))
    return tuple(out)


def profile_points(table, choice: Sequence[int], analysis: Analysis) -> tuple[dict, ...]:
    """Every profiled combination of every segment kind: time, memory, whether the plan chose it."""
    firsts = {}
    for s in analysis.segments:
        firsts.setdefault(s.kind, s)
    out = []
    for kind, prof in table.segments.items():
        seg = firsts.get(kind)
        picked = tuple(choice[b] for b in seg.blocks) if seg is not None else None
        for e in prof.entries:
            out.append({"segment_kind": kind, "choice": list(e.choice), "time_s": e.time, "memory_bytes": e.memory,
                        "measured": e.measured is not None, "chosen": tuple(e.choice) == picked})
    return tuple(out)
