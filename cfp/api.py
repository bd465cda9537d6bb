"""`autoshard`: analysis, profiling and search in one call, returning the sharded step."""
from __future__ import annotations

import os
from typing import Callable

from cfp.analysis.analysis import analyze_with_program
from cfp.ir.state import mapping_pairs, set_state_pairs
from cfp.mesh import MeshSpec
from cfp.baselines.user_layouts import Layout
from cfp.sharding.specs import StepShardings, resolve
from cfp.sharding.step import ShardedStep, apply_choice
from cfp.profiling.profiler import profile
from cfp.errors import ConfigError, PlanError
from cfp.search.plan import Plan, load_plan, make_plan, spec_entries, spec_from_entries
from cfp.search.search import search
from cfp.report.estimates import with_estimates
from cfp.search.options import SearchOptions
from cfp.xla.log import quiet_compiles

__all__ = ["autoshard", "load_plan", "apply_plan", "Plan"]


def autoshard(step_fn: Callable, mesh, *example_args, options: SearchOptions | None = None, memory_limit=None,
              profiler: str | None = None, gpu: str | None = None, iters: int | None = None,
              top_k: int | None = None, max_combinations: int | None = None, verify: int | None = None,
              cache_dir: str | None = None, plan_out: str | None = None, shard_state: bool | None = None,
              state: dict | None = None, donate: bool | None = None, verbose: bool = False) -> ShardedStep:
    """Search the fastest intra-operator plan of `step_fn(*example_args)` on `mesh` within `memory_limit`.

    `mesh`: a jax Mesh, a `MeshSpec` or "2x4". How to search is a `SearchOptions` (`options`; None: its
    defaults, the same as `cfp search`'s); the keywords given (not None) replace its fields: `memory_limit`
    (`memory_per_device`: per-device bytes or a string like "2GB"), `profiler` ("measure": time on the local
    devices, or "estimate": cost model of `gpu`), `iters`, `top_k`, `max_combinations`, `verify`,
    `cache_dir` (a profile cache; None: none), `shard_state` (under a budget, also consider storing parameters
    and optimizer state sharded, ZeRO-3) and `donate`. Returns the
    `ShardedStep` (call it like `step_fn`): `.plan` is the `Plan` to save and reapply (`cfp.apply_plan`),
    `.shardings` the applied `StepShardings`, `.search` the `SearchResult` (figures, `report()`), `.profile`
    the `ProfileTable`. Raises InfeasibleError when nothing fits `memory_limit`.

    The step's state (parameters, optimizer state: the inputs it returns updated) is found from the program
    whatever the order of arguments and outputs; `state` names it instead, as {argument index: index in the
    step's output tuple}, e.g. {0: 1, 3: 2} for `(params, x, y, opt_state) -> (loss, params, opt_state)`.
    State outputs leave with their inputs' shardings, so the step chains in a loop; `donate` hands the state
    inputs' buffers to those outputs (the budget then counts them once). Any jax Mesh works (Explicit, Auto or
    mixed axis types: the plan is the same).
    """
    log = print if verbose else (lambda *_: None)
    if hasattr(mesh, "devices"):
        mesh = MeshSpec.auto(mesh)
    given = {"memory_per_device": memory_limit, "kind": profiler, "gpu": gpu, "iters": iters, "top_k": top_k,
             "max_combinations": max_combinations, "verify": verify, "cache_dir": cache_dir,
             "shard_state": shard_state, "donate": donate}
    if options is not None and not isinstance(options, SearchOptions):
        raise ConfigError(f"options={options!r} must be a SearchOptions")
    sopts = (options or SearchOptions()).replace(progress=verbose,
                                                 **{k: v for k, v in given.items() if v is not None})
    popts, donate = sopts.profile, sopts.donate
    analysis, program = analyze_with_program(step_fn, MeshSpec.of(mesh), *example_args)
    if state is not None:
        set_state_pairs(analysis.graph, mapping_pairs(program.in_tree, program.out_tree, state))
    with quiet_compiles() as xla_log:
        table = profile(program, analysis, popts, log=log)
        result = search(program, analysis, table, example_args, sopts, log=log,
                        mesh=mesh if hasattr(mesh, "devices") else None)
        xla_log.what = f"{table.compiles} profile and {len(result.steps)} whole-step candidate compiles"
    b = result.best
    step = result.steps.get(b.key)   # already compiled while verifying
    if b.layout and (step is None or donate):
        step = ShardedStep(program, analysis, step.shardings, step.mesh, donate=donate)
    elif step is None or donate:    # the search timed steps without donation: their arguments are reused
        step = apply_choice(program, analysis, result.choice, mesh if hasattr(mesh, "devices") else None,
                            shard_state=result.shard_state, donate=donate)
    plan = make_plan(analysis, step.shardings, {"time": b.time, "dp_time": b.dp_time, "memory": b.memory,
                                                "flops": b.flops, "profiler": str(table.profiler),
                                                "candidate": b.label}, layout=b.layout)
    # the same Plan `cfp search --plan-out` writes: per-block estimates and profile points for `cfp explain`
    plan = with_estimates(plan, analysis, table, popts.gpu)
    if plan_out:
        plan.save(plan_out)
    return step.with_results(plan=plan, search=result, profile=table)


def apply_plan(step_fn: Callable, mesh, *example_args, plan) -> ShardedStep:
    """Shard `step_fn` with `plan`: a `Plan`, a plan file's path, or a choice (one strategy index per block).

    A saved plan must match the step: same mesh shape, same blocks (fingerprints) and, once applied, the same
    PartitionSpec for every input; `mesh` may be None to use the plan's. Mismatches raise `PlanError`.
    """
    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(os.fspath(plan))
    if not isinstance(plan, Plan):
        if mesh is None:
            raise ConfigError("apply_plan with a choice needs a mesh")
        analysis, program = analyze_with_program(step_fn, mesh, *example_args)
        step = apply_choice(program, analysis, plan, mesh if hasattr(mesh, "devices") else None)
        return step.with_results(plan=make_plan(analysis, step.shardings))
    analysis, program = analyze_with_program(step_fn, mesh if mesh is not None else plan.mesh, *example_args)
    if tuple(analysis.mesh.shape) != tuple(plan.mesh_shape):
        raise PlanError(f"plan is for mesh {plan.mesh_shape}, the step was given mesh {analysis.mesh.shape}")
    _check_blocks(plan, tuple(b.fingerprint for b in analysis.blocks))
    if plan.layout:
        step = _layout_step(plan, program, analysis, mesh)
    else:
        step = apply_choice(program, analysis, plan.choice, mesh if hasattr(mesh, "devices") else None,
                            shard_state=plan.shard_state)
    _check_input_specs(plan, make_plan(analysis, step.shardings).input_specs)
    return step.with_results(plan=plan)


def _layout_step(plan: Plan, program, analysis, mesh) -> ShardedStep:
    """The step of a plan that is a `Layout` (a plain layout or the ILP's plan): its stored input and output
    specs, and for the ILP's plan its choice's blocks constrained."""
    layout = Layout(plan.layout)
    paths = analysis.graph.input_paths
    missing = [p for p in paths if p not in plan.input_specs]
    if missing:
        raise PlanError(f"input {missing[0]}: the plan stores no spec for it ({len(missing)} inputs missing)")
    if len(plan.output_specs) != len(analysis.graph.outputs):
        raise PlanError(f"the plan stores {len(plan.output_specs)} output specs, the step has "
                        f"{len(analysis.graph.outputs)} outputs")
    base = resolve(analysis, plan.choice)
    shardings = StepShardings(base.choice, base.layouts if layout.constrained else (),
                              tuple(spec_from_entries(plan.input_specs[p]) for p in paths),
                              tuple(spec_from_entries(e) for e in plan.output_specs), (),
                              constrained=layout.constrained)
    return ShardedStep(program, analysis, shardings, mesh if hasattr(mesh, "devices") else analysis.mesh.make())


def _check_blocks(plan: Plan, fps: tuple[str, ...]) -> None:
    if len(fps) != len(plan.block_fingerprints):
        raise PlanError(f"plan has {len(plan.block_fingerprints)} blocks, this step has {len(fps)}; "
                        f"search again for this step")
    for i, (want, got) in enumerate(zip(plan.block_fingerprints, fps)):
        if want != got:
            raise PlanError(f"block {i} differs: the plan's fingerprint is {want}, this step's is {got} "
                            f"(first of {sum(a != b for a, b in zip(plan.block_fingerprints, fps))} differing "
                            f"blocks); search again for this step")


def _check_input_specs(plan: Plan, derived: dict[str, list]) -> None:
    """The plan's stored input specs must be those its choice gives this step (a hand-edited or foreign plan
    would otherwise place inputs differently from what the file says)."""
    for path in list(plan.input_specs) + [p for p in derived if p not in plan.input_specs]:
        want = spec_entries(spec_from_entries(plan.input_specs[path])) if path in plan.input_specs else None
        got = derived.get(path)
        if want != got:
            raise PlanError(f"input {path}: the plan stores spec {want}, its choice gives this step {got} "
                            f"({'missing' if want is None else 'absent from the step' if got is None else 'differs'})")
