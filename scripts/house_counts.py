"""Counts of the house rules over cfp/ (tests/test_house.py holds the checks): functions over 80 lines, calls
and functions with more than 8 positional arguments, module file names shared, imports climbing the pass order.

    python scripts/house_counts.py          # a count per rule, then each offender
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import test_house as house  # noqa: E402


def main() -> int:
    modules = [(p.relative_to(ROOT).as_posix(), ast.parse(p.read_text(), str(p)))
               for p in sorted((ROOT / "cfp").rglob("*.py"))]
    rules = {
        f"functions over {house.MAX_LINES} lines": [o for rel, t in modules for o in house.long_functions(t, rel)],
        f"calls/defs with more than {house.MAX_POSITIONAL} positional":
            [o for rel, t in modules for o in house.positional_offenders(t, rel)],
        "module file names shared": [f"{k}: {v}" for k, v in house.shared_module_names(r for r, _ in modules).items()],
        "imports climbing the pass order": [f"{a} -> {b}: {w}" for rel, t in modules
                                            for a, b, w in house.climbing_imports(t, rel)],
    }
    for rule, found in rules.items():
        print(f"{rule}: {len(found)}")
        for f in found:
            print(f"    {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
