"""The house rules the package keeps, checked over its source with `ast`: functions under 80 lines, records
and long signatures built by keyword, one module per file name, no import of a later pass from an earlier one."""
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


MAX_POSITIONAL = 8


def _positional_params(f):
    return [a.arg for a in f.args.posonlyargs + f.args.args if a.arg not in ("self", "cls")]


def positional_offenders(tree, rel, limit=MAX_POSITIONAL):
    """Calls passing more than `limit` positional arguments and functions taking more than `limit` positional
    parameters (self/cls aside; keyword-only ones don't count): such records and calls are built by keyword."""
    calls = [f"{rel}:{n.lineno} call {ast.unparse(n.func)}({len(n.args)} positional)"
             for n in ast.walk(tree) if isinstance(n, ast.Call) and len(n.args) > limit]
    defs = [f"{rel}:{f.lineno} def {f.name}({len(_positional_params(f))} positional)"
            for f in _functions(tree) if len(_positional_params(f)) > limit]
    return calls + defs


def test_records_and_long_signatures_are_built_by_keyword(modules):
    offenders = [o for rel, tree in modules for o in positional_offenders(tree, rel)]
    assert offenders == [], f"more than {MAX_POSITIONAL} positional arguments: {offenders}"


def test_the_positional_check_counts_arguments():
    nine = ", ".join("abcdefghi")
    assert positional_offenders(ast.parse(f"R({nine})"), "m.py") != []
    assert positional_offenders(ast.parse(f"def f({nine}): pass"), "m.py") != []
    assert positional_offenders(ast.parse(f"def f(self, {nine[3:]}, *, j, k, l): pass"), "m.py") == []
    assert positional_offenders(ast.parse(f"R({nine[3:]}, j=1, k=2, l=3)"), "m.py") == []


# File names shared by modules of different passes when this check came in (a pass's module and the `cli/`
# command or the other pass's module of the same name). New ones are not allowed; renaming one of these means
# removing it here (the test fails while a listed name is no longer shared).
KNOWN_SHARED_NAMES = frozenset({
    "analysis.py", "loops.py", "api.py", "common.py", "explain.py", "launch.py", "plan.py", "search.py",
    "train.py", "dispatch.py", "state.py", "layered.py", "build.py", "check.py", "costmodel.py", "options.py",
    "partition.py"})


def shared_module_names(paths) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for rel in paths:
        name = rel.rsplit("/", 1)[-1]
        if name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(name, []).append(rel)
    return {k: v for k, v in by_name.items() if len(v) > 1}


def test_one_module_per_name(modules):
    shared = shared_module_names(rel for rel, _ in modules)
    assert "layout.py" not in shared, shared.get("layout.py")
    assert set(shared) - KNOWN_SHARED_NAMES == set(), {k: shared[k] for k in set(shared) - KNOWN_SHARED_NAMES}
    assert KNOWN_SHARED_NAMES - set(shared) == set(), "no longer shared: drop from KNOWN_SHARED_NAMES"


def test_the_name_check_finds_shared_names():
    assert shared_module_names(["cfp/a/x.py", "cfp/b/x.py", "cfp/a/__init__.py", "cfp/__init__.py"]) == {
        "x.py": ["cfp/a/x.py", "cfp/b/x.py"]}


# The passes in the order data flows through them (README's package map); the floor (errors, files, mesh,
# layout, version, corpus, xla/, hardware/, models/, ...) and the side rooms (baselines/, report/, layered/,
# api.py) are not ranked. `cfp` itself (the public API package) is above every pass but the CLI.
PASS_ORDER = ("ir", "analysis", "sharding", "profiling", "search", "planner", "runtime", "data", "cfp", "cli")
# Climbs present when this check came in, each to be moved down (the test fails once one is gone):
# the planner reads the runtime's schedule names and (`planner/check.py`) runs its engine.
KNOWN_CLIMBS = frozenset({("planner", "runtime")})


def _pass_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "cfp":
        return None
    return "cfp" if len(parts) == 1 else parts[1]


def climbing_imports(tree, rel) -> list[tuple[str, str, str]]:
    """(from pass, to pass, where) of each import in module `rel` of a pass later in PASS_ORDER than its own."""
    own = _pass_of(rel.removesuffix(".py").replace("/", "."))
    if own not in PASS_ORDER:
        return []
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            targets = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            targets = [n.module]
        else:
            continue
        for t in targets:
            to = _pass_of(t)
            if to in PASS_ORDER and PASS_ORDER.index(to) > PASS_ORDER.index(own):
                out.append((own, to, f"{rel}:{n.lineno} imports {t}"))
    return out


def test_no_import_climbs_a_floor(modules):
    climbs = [c for rel, tree in modules for c in climbing_imports(tree, rel)]
    assert [where for own, to, where in climbs if (own, to) not in KNOWN_CLIMBS] == []
    assert KNOWN_CLIMBS - {(own, to) for own, to, _ in climbs} == set(), "gone: drop from KNOWN_CLIMBS"


def test_the_climb_check_finds_climbs():
    assert climbing_imports(ast.parse("import cfp"), "cfp/profiling/cachekey.py") != []
    assert climbing_imports(ast.parse("from cfp.data.corpus import X"), "cfp/runtime/training.py") != []
    assert climbing_imports(ast.parse("from cfp.analysis import y\nimport cfp.errors"), "cfp/search/s.py") == []
