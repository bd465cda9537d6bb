"""Read a plan: load a plan file (a saved `Plan`), print it per block, diff two plans.

A `Plan` saved by `cfp search --plan-out`, `cfp.autoshard(plan_out=...)` or `Plan.save` after a search carries
its per-block estimates (`Plan.estimates`) and profile points. A plan file without them (older cfp, or a plan
made from a bare choice) is printed with its strategies only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from cfp.errors import ConfigError
from cfp.hardware.gpus import get_gpu
from cfp.report.figures import BlockFigures, plan_figures

ESTIMATE_NOTE = ("all figures are cost-model estimates ({gpu}), per device and step: compute = dots at the "
                 "GPU's achievable rate for their dtype, precision and shape; comm = the block's predicted "
                 "collectives; memory = bytes of the tensors the block's layout places")
LOOP_NOTE = ("  a block with runs xN is in a scan body: its compute, comm and memory are per iteration, and it runs "
             "N times per step (the totals count every iteration)")


@dataclasses.dataclass(frozen=True)
class PlanView:
    """What explain/diff/plot need of a plan file."""

    path: str
    choice: tuple[int, ...]
    strategies: tuple[str, ...]
    figures: tuple[BlockFigures, ...]      # empty: the file carries no estimates
    profile: tuple[dict, ...]
    gpu: str | None
    meta: dict[str, Any]


def load_view(path: str, gpu: str | None = None) -> PlanView:
    """Load a plan file for reading: the `Plan` that `cfp search --plan-out`, `Plan.save` and the golden plans
    write, validated by `cfp.load_plan` (a bad field, or a choice outside a block's strategies, raises
    `PlanError` naming the file and the field)."""
    from cfp.search.plan import load_plan
    plan = load_plan(path)
    saved_gpu = plan.metrics.get("estimates_gpu")
    if gpu is not None and (not plan.estimates or get_gpu(gpu).name != saved_gpu):
        # figures for another GPU are computed, never relabelled: rebuild the analysis from the plan's model
        from cfp.report.estimates import rebuild_analysis
        figures = plan_figures(rebuild_analysis(plan, f"plan file {path!r}"), plan.choice, get_gpu(gpu))
        saved_gpu = get_gpu(gpu).name
    else:
        figures = tuple(BlockFigures.from_dict(e) for e in plan.estimates)
    if figures and len(figures) != len(plan.choice):
        raise ConfigError(f"plan file {path!r}: {len(figures)} block estimates for {len(plan.choice)} blocks")
    meta = {"mesh": "x".join(map(str, plan.mesh_shape)), **plan.metrics}
    return PlanView(path, plan.choice, plan.strategies, figures, tuple(plan.profile), saved_gpu, meta)


def _ms(s: float) -> str:
    return f"{s * 1e3:9.4f}"


def explain_text(view: PlanView) -> str:
    lines = [f"plan {view.path}: {len(view.choice)} blocks"
             + "".join(f", {k} {v}" for k, v in view.meta.items() if k in ("model", "mesh", "config", "profiler"))]
    if not view.figures:
        lines.append("this plan file carries no per-block estimates (an older cfp, or a plan made from a bare "
                     "choice); strategies only:")
        lines += [f"  {b:>4}  {s}" for b, s in enumerate(view.strategies)]
        return "\n".join(lines)
    lines.append(ESTIMATE_NOTE.format(gpu=view.gpu))
    looped = any(f.repeat > 1 for f in view.figures)
    if looped:
        lines.append(LOOP_NOTE)
    lines.append(f"  {'blk':>4} {'scope':<28} {'strategy':<34} {'compute ms':>10} {'comm ms':>9} "
                 f"{'memory MB':>10}{'  runs' if looped else ''}  runner-up (time difference)")
    for f in view.figures:
        ru = (f"{f.runner_up} ({'+' if f.runner_up_delta_s >= 0 else ''}{f.runner_up_delta_s * 1e3:.4f} ms)"
              if f.runner_up is not None else "none (single strategy)")
        runs = f"  {'x' + str(f.repeat) if f.repeat > 1 else '1':>4}" if looped else ""
        lines.append(f"  {f.block:>4} {f.scope[-28:]:<28} {f.strategy[:34]:<34} {_ms(f.compute_s):>10} "
                     f"{_ms(f.comm_s)} {f.memory_bytes / 1e6:10.3f}{runs}  {ru}")
    if any(f.runner_up_delta_s is not None and f.runner_up_delta_s < 0 for f in view.figures):
        lines.append("  a negative difference: this block alone would be cheaper under the runner-up; the search "
                     "chose by profiled segment times including the resharding between blocks")
    lines += _loop_lines(view.figures)
    tot = sum(f.step_time_s for f in view.figures)
    lines.append(f"  total (estimated, blocks summed{' over every iteration' if looped else ''}, no resharding): "
                 f"{tot * 1e3:.4f} ms, {sum(f.step_memory_bytes for f in view.figures) / 1e6:.3f} MB")
    return "\n".join(lines)


def _loop_lines(figures) -> list[str]:
    """Per scan body (blocks sharing a segment that runs more than once): its figures per iteration and in total."""
    bodies: dict[tuple[int, int], list] = {}
    for f in figures:
        if f.repeat > 1:
            bodies.setdefault((f.segment, f.repeat), []).append(f)
    out = []
    for (seg, n), fs in bodies.items():
        t, m = sum(f.time_s for f in fs), sum(f.memory_bytes for f in fs)
        out.append(f"  scan body, segment {seg} (blocks {fs[0].block}..{fs[-1].block}): per iteration "
                   f"{t * 1e3:.4f} ms, {m / 1e6:.3f} MB; x{n} iterations: total {t * n * 1e3:.4f} ms, "
                   f"{m * n / 1e6:.3f} MB (estimated)")
    return out


def diff_text(a: PlanView, b: PlanView) -> str:
    """The blocks two plans give different strategies, with the estimated cost of each side."""
    if len(a.choice) != len(b.choice):
        raise ConfigError(f"plans have {len(a.choice)} and {len(b.choice)} blocks: not the same model")
    differ = [i for i in range(len(a.choice)) if a.strategies[i] != b.strategies[i] or a.choice[i] != b.choice[i]]
    lines = [f"A = {a.path}\nB = {b.path}\n{len(differ)} of {len(a.choice)} blocks differ"]
    if str(a.meta.get("mesh")) != str(b.meta.get("mesh")):
        lines.append(f"  note: the plans are for different meshes (A {a.meta.get('mesh')}, B {b.meta.get('mesh')}): "
                     f"the same notation can mean other device groups")
    both = bool(a.figures and b.figures)
    if both:
        lines.append(ESTIMATE_NOTE.format(gpu=a.gpu if a.gpu == b.gpu else f"A: {a.gpu}, B: {b.gpu}"))
    for i in differ:
        scope = a.figures[i].scope if a.figures else (b.figures[i].scope if b.figures else f"block_{i}")
        line = f"  {i:>4} {scope:<28} A {a.strategies[i]}  |  B {b.strategies[i]}"
        if both:
            fa, fb = a.figures[i], b.figures[i]
            line += (f"  time {fa.step_time_s * 1e3:.4f} -> {fb.step_time_s * 1e3:.4f} ms "
                     f"({(fb.step_time_s - fa.step_time_s) * 1e3:+.4f}), memory "
                     f"{(fb.step_memory_bytes - fa.step_memory_bytes) / 1e6:+.3f} MB"
                     + (f" (per step: x{fa.repeat} iterations)" if fa.repeat > 1 else ""))
        lines.append(line)
    if both:
        ta, tb = sum(f.step_time_s for f in a.figures), sum(f.step_time_s for f in b.figures)
        lines.append(f"  estimated block time A {ta * 1e3:.4f} ms, B {tb * 1e3:.4f} ms, B - A {(tb - ta) * 1e3:+.4f} ms")
    else:
        lines.append("  (no cost delta: a plan file lacks per-block estimates)")
    return "\n".join(lines)
