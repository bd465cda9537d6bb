"""The numeric equivalence tests of the runtime and of applied plans at XLA's default optimisation level.

The suite runs at `--xla_backend_optimization_level=0` (tests/conftest.py: half the compile time), which no user
runs; optimisation reorders float sums and fuses differently, so a representative set of the equivalence tests
runs again here, in a subprocess whose XLA_FLAGS leave the level at XLA's default (JAX reads the flags once)."""
import os
import re
import subprocess
import sys

import pytest

from conftest import DEFAULT_OPT_ENV, O0_FLAG

HERE = os.path.dirname(os.path.abspath(__file__))
REPRESENTATIVE = (
    "tests/test_default_opt_level.py::test_this_process_runs_at_the_level_it_was_asked_for",
    # runtime: TP-2 and TP-1 pipeline stages, GPipe and 1F1B, vs one device (gradients, losses, parameters)
    "tests/test_runtime.py::test_matches_single_device_gpipe_and_1f1b[tp2-into-tp1]",
    # applied plans: a sharded AdamW train step vs the unsharded one; Llama-2 loss and gradients under the first
    # and a random strategy choice on a 2x4 mesh vs unsharded
    "tests/test_apply.py::test_full_train_step_matches_single_device",
    "tests/test_apply.py::test_sharded_loss_and_grads_match_unsharded_and_collectives_match_prediction"
    "[llama2-2x4-kinds2]",
)


def test_this_process_runs_at_the_level_it_was_asked_for():
    """O0 in the suite; XLA's default (no level flag) in the subprocess below."""
    flags = os.environ["XLA_FLAGS"]
    assert (O0_FLAG in flags) == (os.environ.get(DEFAULT_OPT_ENV) != "1"), flags


@pytest.mark.skipif(os.environ.get(DEFAULT_OPT_ENV) == "1", reason="already the default-level run")
def test_equivalence_at_xla_default_optimization_level():
    env = dict(os.environ, **{DEFAULT_OPT_ENV: "1"})
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if f != O0_FLAG and not f.startswith("--xla_force_host_platform_device_count"))
    root = os.path.dirname(HERE)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *REPRESENTATIVE],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(rf"\b{len(REPRESENTATIVE)} passed\b", out), out[-3000:]   # every one ran, none skipped
