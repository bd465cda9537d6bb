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


def shared_module_names(paths) -> dict[str, list[str]]:
    """File names more than one module of `paths` has, but for the two kinds of module whose name says
    where it is: a `cli/` module named after the `cfp` command it implements (`cli/plan.py` is `cfp plan`), and
    a pass's one options record, `<pass>/options.py` (one options dataclass per pass)."""
    by_name: dict[str, list[str]] = {}
    for rel in paths:
        name = rel.rsplit("/", 1)[-1]
        if name in ("__init__.py", "__main__.py"):
            continue
        if rel == f"cfp/cli/{name}" and name[:-3] in CLI_COMMANDS:
            continue
        if name == "options.py" and rel.count("/") == 2 and not rel.startswith("cfp/cli/"):
            continue
        by_name.setdefault(name, []).append(rel)
    return {k: v for k, v in by_name.items() if len(v) > 1}


def _cli_commands() -> frozenset:
    from cfp.cli.main import SUBCOMMANDS
    return frozenset(name for name, module in SUBCOMMANDS.items() if module == f"cfp.cli.{name}")


CLI_COMMANDS = _cli_commands()


def test_one_module_per_name(modules):
    shared = shared_module_names(rel for rel, _ in modules)
    assert shared == {}, f"module file names shared by two modules (rename one): {shared}"


def test_the_name_check_finds_shared_names():
    assert shared_module_names(["cfp/a/x.py", "cfp/b/x.py", "cfp/a/__init__.py", "cfp/__init__.py"]) == {
        "x.py": ["cfp/a/x.py", "cfp/b/x.py"]}
    # a command's module beside a pass's module of its name, and per-pass options records, are allowed...
    assert shared_module_names(["cfp/cli/plan.py", "cfp/search/plan.py", "cfp/a/options.py",
                                "cfp/b/options.py"]) == {}
    # ...but not a cli module that is no command, nor options modules deeper down
    assert shared_module_names(["cfp/cli/common.py", "cfp/models/common.py"]) != {}
    assert shared_module_names(["cfp/a/options.py", "cfp/a/b/options.py", "cfp/cli/options.py"]) != {}
    assert {"plan", "search", "train", "explain", "analysis", "launch"} <= CLI_COMMANDS


# The passes in the order data flows through them (README's package map); the floor (errors, files, mesh,
# layout, version, corpus, xla/, hardware/, models/, ...) and the side rooms (baselines/, report/, layered/,
# api.py) are not ranked. `cfp` itself (the public API package) is above every pass but the CLI.
PASS_ORDER = ("ir", "analysis", "sharding", "profiling", "search", "planner", "runtime", "data", "cfp", "cli")



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
    assert [where for own, to, where in climbs] == []


def test_the_climb_check_finds_climbs():
    assert climbing_imports(ast.parse("import cfp"), "cfp/profiling/cachekey.py") != []
    assert climbing_imports(ast.parse("from cfp.data.corpus import X"), "cfp/runtime/training.py") != []
    assert climbing_imports(ast.parse("from cfp.analysis import y\nimport cfp.errors"), "cfp/search/s.py") == []
