"""README.md's Python examples run as written.

Contract for README authors: every ```python block of README.md runs, in order, in ONE shared namespace
(a later block may use names an earlier one defined), with the current directory a fresh temporary one.
Before the first block, this prelude defines (and nothing else):

    step_fn              the optax AdamW train step of a 1-layer tiny GPT: (params, opt_state, batch) ->
                         (params, opt_state, loss)
    params, opt_state    its initialised parameters and optimizer state
    batch                a batch of 8 sequences

on 8 simulated CPU devices. Blocks should use only `import cfp` names and stay quick on this model (e.g.
`profiler="estimate"` for searches); a block that raises fails the test with the block's first line.
Blocks whose first line is `# not run` are skipped (e.g. ones needing a real GPU cluster).
"""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

PRELUDE = """
import jax
from cfp.models import get_config, train_step as _train_step
_ts = _train_step("gpt", get_config("gpt", "tiny", num_layers=1))
step_fn = _ts.step
params, opt_state = jax.jit(_ts.init)(jax.random.PRNGKey(0))
batch = _ts.make_batch(8, jax.random.PRNGKey(1))
"""


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


def run_python_blocks(markdown: str) -> int:
    """Run the blocks as the contract says; returns how many ran."""
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(PRELUDE, "<readme prelude>", "exec"), namespace)
    ran = 0
    for i, block in enumerate(python_blocks(markdown)):
        if block.startswith("# not run"):
            continue
        try:
            exec(compile(block, f"<README.md python block {i}>", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README python block {i} ({block.splitlines()[0]!r}) raised "
                                 f"{type(e).__name__}: {e}") from e
        ran += 1
    return ran


def test_python_blocks_are_found():
    assert python_blocks("x\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a\n```\n") == \
        ["a = 1\n", "b = a\n"]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(README.read_text())
    if not blocks:
        pytest.skip("README.md has no python block")
    assert run_python_blocks(README.read_text()) >= 1
