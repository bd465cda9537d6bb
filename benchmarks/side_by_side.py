"""The benchmarks' shared pieces: one timing loop, sharded steps timed side by side (every step in turn in each
round, see `cfp.xla.compiled.time_interleaved`) so a burst of load on a shared host lands on all of them alike;
and the language-model training step builder of `tests/programs.py` (`lm_step_problem`).

    from side_by_side import time_side_by_side      # benchmarks/ is on sys.path when a benchmark runs
"""
import os
import sys
from collections.abc import Mapping

import jax

from cfp.xla.compiled import time_interleaved

# the suite's user-style step builder, one copy for the tests and the benchmarks (re-exported); imported as
# the suite imports it (`tests/` on the path), not as `tests.programs`, which a dependency's own `tests`
# package could shadow
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from programs import lm_step_problem  # noqa: E402,F401


def time_side_by_side(steps: Mapping, args, rounds: int, warmup: int = 2) -> dict:
    """name -> (median wall seconds, relative noise) of each `ShardedStep` in `steps` (measured). `args`: the
    step arguments, one tuple for all or a mapping name -> tuple; each run gets them freshly placed with its
    step's input shardings (only one step's placed arguments live at a time)."""
    def args_of(name):
        return args[name] if isinstance(args, Mapping) else args
    runs = [(s.compile(*args_of(k)), lambda s=s, k=k: jax.tree_util.tree_leaves(s.shard_args(*args_of(k))))
            for k, s in steps.items()]
    return dict(zip(steps, time_interleaved(runs, rounds, warmup)))
