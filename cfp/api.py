"""`autoshard`: analysis, profiling and search in one call, returning the sharded step."""
from __future__ import annotations

from typing import Callable

from cfp.analysis.analysis import analyze_with_program
from cfp.mesh import MeshSpec
from cfp.sharding.step import ShardedStep, apply_choice
from cfp.profiling.options import ProfileOptions
from cfp.profiling.profiler import profile
from cfp.search.plan import Plan, apply_plan, load_plan, make_plan
from cfp.search.search import search
from cfp.search.options import SearchOptions

__all__ = ["autoshard", "load_plan", "apply_plan", "Plan"]


def autoshard(step_fn: Callable, mesh, *example_args, memory_limit=None, profiler: str = "measure",
              gpu: str | None = None, iters: int = 5, top_k: int = 4, max_combinations: int = 12,
              verify: int = 2, cache_dir: str | None = None, plan_out: str | None = None,
              shard_state: bool = True, verbose: bool = False) -> ShardedStep:
    """Search the fastest intra-operator plan of `step_fn(*example_args)` on `mesh` within `memory_limit`.

    `mesh`: a jax Mesh, a `MeshSpec` or "2x4"; `memory_limit`: per-device bytes or a string like "2GB";
    `profiler`: "measure" (time on the local devices) or "estimate" (cost model of `gpu`); `shard_state`: under
    a budget, also consider storing parameters and optimizer state sharded (ZeRO-3). Returns the
    `ShardedStep` (call it like `step_fn`): `.plan` is the `Plan` to save and reapply (`cfp.apply_plan`),
    `.shardings` the applied `StepShardings`, `.search` the `SearchResult` (figures, `report()`), `.profile`
    the `ProfileTable`. Raises InfeasibleError when nothing fits `memory_limit`.
    """
    log = print if verbose else (lambda *_: None)
    popts = ProfileOptions(kind=profiler, gpu=gpu, iters=iters, cache_dir=cache_dir,
                           max_combinations=max_combinations, progress=verbose)
    sopts = SearchOptions(memory_per_device=memory_limit, top_k=top_k, verify=verify, iters=iters,
                          shard_state=shard_state)
    analysis, program = analyze_with_program(step_fn, MeshSpec.of(mesh), *example_args)
    table = profile(program, analysis, popts, log=log)
    result = search(program, analysis, table, example_args, sopts, log=log,
                    mesh=mesh if hasattr(mesh, "devices") else None)
    step = result.steps.get((result.choice, result.shard_state))   # already compiled while verifying
    if step is None:
        step = apply_choice(program, analysis, result.choice, mesh if hasattr(mesh, "devices") else None,
                          shard_state=result.shard_state)
    b = result.best
    plan = make_plan(analysis, step.shardings, {"time": b.time, "dp_time": b.dp_time, "memory": b.memory,
                                                "flops": b.flops, "profiler": str(table.profiler)})
    if plan_out:
        plan.save(plan_out)
    return step.with_results(plan=plan, search=result, profile=table)
