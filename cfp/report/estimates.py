"""The per-block estimates every saved plan carries, however it was saved (`cfp search --plan-out`,
`cfp.autoshard(plan_out=...)`, the golden plans), and their recomputation for another GPU.

A plan that names its model (`model_metrics`: model, its full config, batch size) can be re-estimated for any
catalog GPU by rebuilding the analysis from shapes alone; a plan of the user's own step cannot, and says so.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from cfp.errors import ConfigError
from cfp.hardware.gpus import DEFAULT_GPU, get_gpu
from cfp.report.figures import plan_figures, profile_points


def model_metrics(model: str, config, batch_size: int) -> dict[str, Any]:
    """What a plan records to rebuild its step: the model name, every config field and the batch size."""
    return {"model": model, "model_config": dataclasses.asdict(config), "batch_size": int(batch_size)}


def with_estimates(plan, analysis, table=None, gpu: str | None = None):
    """`plan` with its per-block estimates on `gpu` (default: `DEFAULT_GPU`) and, given the profile table,
    every profiled combination's point, for `cfp explain`/`diff`/`--plot`."""
    spec = get_gpu(gpu or DEFAULT_GPU)
    figures = tuple(f.to_dict() for f in plan_figures(analysis, plan.choice, spec))
    points = profile_points(table, plan.choice, analysis) if table is not None else ()
    return dataclasses.replace(plan, estimates=figures, profile=tuple(points),
                               metrics={**plan.metrics, "estimates_gpu": spec.name})


def rebuild_analysis(plan, where: str):
    """The plan's analysis rebuilt from its `model_metrics` (shapes only, no values); its blocks must be the
    plan's (same fingerprints)."""
    import jax

    from cfp.analysis.analysis import analyze_with_program
    from cfp.models import get_config, train_step
    m = plan.metrics
    if not all(k in m for k in ("model", "model_config", "batch_size")):
        raise ConfigError(f"{where} does not name its model (a plan of your own step): its estimates are for "
                          f"{m.get('estimates_gpu') or 'no GPU'} and cannot be recomputed for another GPU")
    if jax.device_count() < plan.mesh.size:
        raise ConfigError(f"{where} is for a mesh of {plan.mesh.size} devices, this process has "
                          f"{jax.device_count()} (set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    ts = train_step(m["model"], get_config(m["model"], **m["model_config"]))
    params, opt = jax.eval_shape(ts.init, jax.random.PRNGKey(0))
    batch = ts.make_batch(int(m["batch_size"]), jax.random.PRNGKey(1))
    analysis, _ = analyze_with_program(ts.step, plan.mesh, params, opt, batch)
    if tuple(b.fingerprint for b in analysis.blocks) != tuple(plan.block_fingerprints):
        raise ConfigError(f"{where}: the rebuilt {m['model']} step's blocks differ from the plan's "
                          f"(saved by another cfp version?); search again")
    return analysis
