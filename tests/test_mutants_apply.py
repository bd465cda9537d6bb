"""benchmarks/mutants.py stays runnable: every mutant's search text is in its file exactly once (a refactor that
moves the code a mutant patches makes the mutant an error, not a check), and the tests it names exist."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("cfp_mutants", ROOT / "benchmarks" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod.MUTANTS


MUTANTS = _mutants()


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_patch_applies_once_and_names_existing_tests(m):
    text = (ROOT / m.file).read_text()
    assert text.count(m.old) == 1, f"{m.name}: its search text occurs {text.count(m.old)} times in {m.file}"
    assert m.old != m.new
    for t in m.tests:
        path = t.split("::")[0]
        assert (ROOT / path).is_file(), f"{m.name}: no test file {path}"
        if "::" in t:
            name = t.split("::")[1].split("[")[0]
            assert f"def {name}(" in (ROOT / path).read_text(), f"{m.name}: no test {name} in {path}"


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
