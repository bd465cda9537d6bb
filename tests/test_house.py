"""The house rules the package keeps, checked over its source with `ast`: functions under 80 lines."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def _modules():
    for path in sorted((ROOT / "cfp").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def long_functions(tree, rel, limit=MAX_LINES):
    return [f"{rel}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for f in _functions(tree) if f.end_lineno - f.lineno + 1 > limit]


@pytest.fixture(scope="module")
def modules():
    return list(_modules())


def test_functions_are_under_80_lines(modules):
    offenders = [o for rel, tree in modules for o in long_functions(tree, rel)]
    assert offenders == [], f"functions over {MAX_LINES} lines: {offenders}"


def test_the_length_check_counts_lines():
    body = "\n".join(f"    x{k} = {k}" for k in range(80))
    assert long_functions(ast.parse(f"def f():\n{body}\n"), "m.py") != []        # 81 lines
    assert long_functions(ast.parse(f"def f():\n{body[:body.rindex(chr(10))]}\n"), "m.py") == []
