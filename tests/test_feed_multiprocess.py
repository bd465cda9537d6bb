"""Each process feeds its own share, for real: 2 processes x 4 CPU devices (`cfp launch`, gloo) train test_feed's
model on test_feed_share's crossing layout (pipeline 0 on process 0, pipeline 1 on process 1, pipeline 2 from
process 0 to process 1) from a generator yielding only the process's rows of each step (6 and 4 of 8:
`cfp.process_share`), with verify (its replay gathers the whole batch); then from the whole global batches. Both
equal the single-process run fed the whole batch and the model's own single-device step. Slow: two processes
compile (about a minute)."""
import json
import os
import subprocess
import sys

import numpy as np
import optax
import pytest

pytestmark = pytest.mark.slow

from test_feed import STEPS, TOL, _batches, _model  # noqa: E402
from test_feed_share import CROSSING  # noqa: E402


def test_each_process_feeds_its_share_and_trains_as_one_process_fed_the_whole_batch(tmp_path):
    import cfp
    rank = os.path.join(os.path.dirname(__file__), "feed_rank.py")
    cmd = [sys.executable, "-m", "cfp.cli.main", "launch", "--nprocs", "2", "--devices-per-proc", "4",
           "--timeout", "500", "--", sys.executable, rank, str(tmp_path)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=560)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{p}.json").read_text()) for p in (0, 1)]
    assert [r["processes"] for r in ranks] == [2, 2]
    # each fed its share only: process 0 pipelines 0 and 2 (rows 0-3, 6-7), process 1 pipelines 1 and 2 (4-7)
    assert [(r["pipelines"], r["fed_rows"]) for r in ranks] == [([0, 2], [6] * STEPS), ([1, 2], [4] * STEPS)]
    # the whole batches handed to every process train the same bits as the shares
    for r in ranks:
        assert r["whole_losses"] == r["share_losses"] and r["whole_vs_share"] == 0.0
        assert r["verify_ok"] and r["verify_error"] < 1e-4, r
        assert r["share_vs_own"] < TOL                     # the model's own single-device step (in the rank)
        np.testing.assert_allclose(r["share_losses"], r["own_losses"], rtol=TOL)
    assert ranks[0]["share_losses"] == ranks[1]["share_losses"]
    # the single-process run fed the whole batch: same programs in one process; only the order in which a TP
    # all-reduce of more than 2 devices adds could differ (as tests/test_runtime_multiprocess.py's runs)
    model, tx = _model(), optax.adamw(1e-2, weight_decay=0.1)
    single = cfp.train_pipelines(model, tx, CROSSING, _batches(STEPS), steps=STEPS, log=lambda *a, **k: None)
    np.testing.assert_allclose(ranks[0]["share_losses"], [single.losses[s] for s in range(1, STEPS + 1)],
                               rtol=1e-6)
