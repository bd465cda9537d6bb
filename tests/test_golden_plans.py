"""Golden plans: the cost-model search picks the recorded plan (regenerate with
`benchmarks/regen_golden_plans.py`; its --check mode compares every case)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("regen", ROOT / "benchmarks" / "regen_golden_plans.py")
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)


def test_every_case_has_a_golden_file():
    for model, mesh, variant in regen.CASES:
        data = json.loads(regen.path_for(model, mesh, variant).read_text())
        assert data["model"] == model and data["mesh"] == mesh
        assert data["settings"] == dict(regen.SETTINGS, **regen.VARIANTS[variant])
        assert len(data["choice"]) == len(data["strategies"])
    # a search that always answered data parallel must not pass: some golden optimum is not all strategy 0
    assert any(set(json.loads(regen.path_for(*c).read_text())["choice"]) != {0} for c in regen.CASES)


# two of the cases keep the suite short; the script checks all of them
@pytest.mark.parametrize("model,mesh", [("gpt", "2x4"), ("llama2", "8")])
def test_search_still_picks_the_golden_plan(model, mesh):
    golden = json.loads(regen.path_for(model, mesh).read_text())
    plan = regen.golden_plan(model, mesh)
    assert plan["choice"] == golden["choice"], (plan["strategies"], golden["strategies"])


def test_non_uniform_golden_plan_beats_data_parallel_on_the_whole_step_cost_model():
    """The wide-vocabulary case's golden optimum is not uniform strategy 0, and an independent check agrees:
    compiling both whole steps, the cost model (not the search's per-segment sums) ranks the golden plan
    faster than strategy 0 everywhere."""
    from cfp.profiling import costmodel
    from cfp.hardware.gpus import get_gpu
    from cfp.sharding.step import apply_choice
    from cfp.xla.compiled import compiled_figures
    golden = json.loads(regen.path_for("gpt", "8", "wide_vocab").read_text())
    assert set(golden["choice"]) != {0}
    step, args = regen.golden_step("gpt", "8", "wide_vocab")
    assert list(step.shardings.choice) == golden["choice"], golden["strategies"]
    a, gpu = step.analysis, get_gpu(regen.SETTINGS["gpu"])
    dtype = costmodel.dominant_dtype(a, range(len(a.blocks)))

    def whole_step_time(choice):
        compiled = apply_choice(step.program, a, choice).compile(*args)
        return costmodel.estimated_time(compiled_figures(compiled, a.mesh.shape), a.mesh.shape, gpu, dtype)
    assert whole_step_time(golden["choice"]) < whole_step_time([0] * len(a.blocks))
