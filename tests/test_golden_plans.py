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


def test_wide_vocabulary_golden_plan_is_not_uniform():
    """The wide-vocabulary case's golden optimum is not uniform strategy 0: the search's segment estimates
    make its LM head vocabulary-parallel, and applying the golden choice reproduces it.

    (Golden plans are made without whole-step verification, verify=0. Under the latency-aware cost model
    the whole-step estimate of this choice is slower than uniform strategy 0 (0.88 vs 0.47 ms): the segment
    sums and the whole step disagree here, a known limit recorded in the README.)"""
    golden = json.loads(regen.path_for("gpt", "8", "wide_vocab").read_text())
    assert set(golden["choice"]) != {0}
    step, _ = regen.golden_step("gpt", "8", "wide_vocab")
    assert list(step.shardings.choice) == golden["choice"], golden["strategies"]
    assert "lm_head" in "/".join(step.analysis.blocks[-1].scope)
    assert golden["choice"][-1] != 0 and set(golden["choice"][:-1]) == {0}
