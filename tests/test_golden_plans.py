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
    for model, mesh in regen.CASES:
        data = json.loads(regen.path_for(model, mesh).read_text())
        assert data["model"] == model and data["mesh"] == mesh and data["settings"] == regen.SETTINGS
        assert len(data["choice"]) == len(data["strategies"])


# two of the cases keep the suite short; the script checks all of them
@pytest.mark.parametrize("model,mesh", [("gpt", "2x4"), ("llama2", "8")])
def test_search_still_picks_the_golden_plan(model, mesh):
    golden = json.loads(regen.path_for(model, mesh).read_text())
    plan = regen.golden_plan(model, mesh)
    assert plan["choice"] == golden["choice"], (plan["strategies"], golden["strategies"])
