"""Every use of JAX internals (jax._src, jax.extend, jax.core, jax.interpreters) lives in one module."""
import re
from pathlib import Path

ALLOWED = {"cfp/ir/_jax_internals.py"}
PATTERN = re.compile(r"^\s*(from|import)\s+jax\.(_src|extend|core|interpreters)\b|jax\._src\.|jax\.core\.|jax\.extend\."
                     r"|^\s*from\s+jax\s+import\s+.*\b(_src|extend|core|interpreters)\b", re.MULTILINE)


def test_internals_live_in_one_module():
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in sorted((root / "cfp").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel not in ALLOWED and PATTERN.search(path.read_text()):
            offenders.append(rel)
    assert offenders == [], f"JAX internals used outside cfp/ir/_jax_internals.py: {offenders}"


def test_the_pattern_catches_internal_imports():
    assert PATTERN.search("from jax._src import core")
    assert PATTERN.search("import jax.extend.core as jc")
    assert PATTERN.search("x = jax.core.Literal")
    assert PATTERN.search("from jax import core")
    assert PATTERN.search("from jax import numpy as jnp, _src")
    assert not PATTERN.search("import jax.numpy as jnp\nfrom jax.sharding import Mesh")
    assert not PATTERN.search("from jax import numpy as jnp, tree_util")
