"""Golden plans (tests/golden/plans/, made by `benchmarks/regen_golden_plans.py` through `cfp.autoshard`) are
ordinary saved `Plan`s, apply to their steps, and are the optimum of an exhaustive reference search.

The reference is independent of the search's DP and of how it assembles its cost rows: it enumerates every
combination of the profiled strategy combinations of every segment and prices each as the sum of the segment
times plus the resharding between consecutive segments (`gpu_estimate.reshard_cost` on the layouts both sides give
each shared tensor). The golden choice must reach that minimum, and the search run again on the same table must
pick it and price it at the reference's figure (the golden plans' heads reshard from the layers' layout, so a
search that dropped the resharding term prices them low and fails here, as does one that pruned the optimum).
"""
import importlib.util
import itertools
import json
from pathlib import Path

import pytest

import cfp
from cfp.search.plan import PLAN_VERSION

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("regen", ROOT / "benchmarks" / "regen_golden_plans.py")
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)

IDS = [f"{m}_{mesh}{'_' + v if v else ''}" for m, mesh, v in regen.CASES]


def test_every_golden_file_is_a_saved_plan():
    for model, mesh, variant in regen.CASES:
        path = regen.path_for(model, mesh, variant)
        plan = cfp.load_plan(str(path))
        assert plan.version == PLAN_VERSION and plan.metrics["model"] == model and plan.metrics["mesh"] == mesh
        assert plan.metrics["golden_settings"] == dict(regen.SETTINGS, **regen.VARIANTS[variant])
        assert len(plan.estimates) == len(plan.choice) == len(plan.num_strategies) and plan.profile
        assert plan.metrics["estimates_gpu"] == regen.SETTINGS["gpu"]
    # a search that always answered data parallel must not pass: some golden optimum is not all strategy 0
    assert any(set(cfp.load_plan(str(regen.path_for(*c))).choice) != {0} for c in regen.CASES)


@pytest.mark.parametrize("case", regen.CASES, ids=IDS)
def test_golden_plan_applies_to_its_step(case):
    model, mesh, variant = case
    ts, args = regen.golden_args(model, variant)
    path = str(regen.path_for(model, mesh, variant))
    step = cfp.apply_plan(ts.step, mesh, *args, plan=path)
    assert step.shardings.choice == cfp.load_plan(path).choice


def _reference_optimum(analysis, table, gpu):
    """(min seconds, the choices reaching it) over every combination of profiled segment entries."""
    from cfp.profiling import gpu_estimate
    segs = analysis.segments
    entries = [table.segments[s.kind].entries for s in segs]
    specs = [[analysis.segment_specs(s, e.choice) for e in es] for s, es in zip(segs, entries)]
    link = gpu.link_gbps * 1e9
    moves = {}

    def move(i, a, b):
        if (i, a, b) not in moves:
            moves[i, a, b] = gpu_estimate.reshard_cost(analysis, specs[i][a], specs[i + 1][b], link)
        return moves[i, a, b]

    def seconds(picks):
        return (sum(entries[i][p].time for i, p in enumerate(picks))
                + sum(move(i, picks[i], picks[i + 1]) for i in range(len(picks) - 1)))

    times = {picks: seconds(picks) for picks in itertools.product(*[range(len(e)) for e in entries])}
    best = min(times.values())
    as_choice = lambda picks: tuple(c for i, p in enumerate(picks) for c in entries[i][p].choice)  # noqa: E731
    return best, {as_choice(p) for p, t in times.items() if t <= best * (1 + 1e-12)}, {
        as_choice(p): t for p, t in times.items()}


# the wide-vocabulary case and the 2-D mesh are the non-uniform optima; the script checks every case
@pytest.mark.parametrize("case", [("gpt", "2x4", ""), ("gpt", "8", "wide_vocab")], ids=["gpt_2x4", "wide_vocab"])
def test_golden_plan_is_the_exhaustive_optimum(case):
    from cfp.analysis.analysis import analyze_with_program
    from cfp.hardware.gpus import get_gpu
    from cfp.profiling.options import ProfileOptions
    from cfp.profiling.profiler import profile
    model, mesh, variant = case
    s = regen.SETTINGS
    golden = cfp.load_plan(str(regen.path_for(model, mesh, variant)))
    ts, args = regen.golden_args(model, variant)
    analysis, program = analyze_with_program(ts.step, cfp.MeshSpec.parse(mesh, 8), *args)
    table = profile(program, analysis, ProfileOptions(kind="estimate", gpu=s["gpu"], cache_dir=None,
                                                      max_combinations=s["max_combinations"], progress=False),
                    log=lambda *_: None)
    best, optima, times = _reference_optimum(analysis, table, get_gpu(s["gpu"]))
    assert golden.choice in times, f"golden choice {golden.choice} is not a combination of profiled entries"
    assert golden.choice in optima, (f"golden plan {golden.choice} takes {times[golden.choice]:.6g} s, the "
                                     f"exhaustive optimum {sorted(optima)} {best:.6g} s")
    assert golden.metrics["dp_time"] == pytest.approx(best, rel=1e-9)
    # the search itself, on the same table, under the golden settings (no whole-step verification)
    from cfp.search.options import SearchOptions
    from cfp.search.search import search
    result = search(program, analysis, table, args, SearchOptions(verify=0), log=lambda *_: None)
    assert result.choice == golden.choice and result.shard_state == golden.shard_state == ()
    assert result.best.dp_time == pytest.approx(best, rel=1e-9), (
        f"the search prices its plan at {result.best.dp_time:.9g} s, the reference at {best:.9g} s")


def test_wide_vocabulary_head_is_vocabulary_parallel():
    """Derived from the shapes: with a 32768-token vocabulary, the LM head kernel's gradient all-reduce under
    data parallelism (32768 x hidden floats) costs more than sharding the vocabulary, so the head's kernel is
    stored split along its vocabulary dim; the other blocks stay data parallel (strategy 0). With the default
    vocabulary (gpt_8), data parallelism leaves the kernel whole."""
    def kernel_spec(plan):
        (spec,) = [v for k, v in plan.input_specs.items() if k.startswith("[0]") and "lm_head" in k
                   and "kernel" in k]
        return spec

    wide = cfp.load_plan(str(regen.path_for("gpt", "8", "wide_vocab")))
    assert kernel_spec(wide)[-1] is not None, kernel_spec(wide)       # (hidden, vocab): vocab sharded
    assert wide.choice[-1] != 0 and set(wide.choice[:-1]) == {0}
    assert all(e is None for e in kernel_spec(cfp.load_plan(str(regen.path_for("gpt", "8")))))
    assert json.loads(regen.path_for("gpt", "8", "wide_vocab").read_text())["metrics"]["model_config"][
        "vocab_size"] == 32768
