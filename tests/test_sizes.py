"""Past the small cases: checkpoint steps, pipelines and micro-batches that cross one digit and exceed two.

* Checkpoints of steps 1 .. 12 and 99 .. 101: `all_steps` ascends by number, the latest is the largest, a
  restore without a step gives that one's state, retention keeps the newest by number.
* 12 pipelines of up to 11 micro-batches: a global batch is cut into each pipeline's own rows in order (offsets
  computed here), and the dispatch order of their tables (`global_order`) keeps every stage's own order.
* Fixed patterns with 100 and 120 micro-batches (GPipe, 1F1B, ZB-H1, interleaved): valid (the executor of
  test_properties_schedules) and, with equal action times, as long as the closed form says:
  ``(m + p - 1) (F + B)`` for GPipe and 1F1B, keeping on stage s at most m (GPipe) or min(p - s, m) (1F1B)
  micro-batches.
* The runtime with 100 micro-batches (slow tier): a 12-layer user model on two stages trains like one device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cfp.layout import Layout
from cfp.runtime.checkpoint import all_steps, latest_step, restore_checkpoint, save_checkpoint
from cfp.runtime.executor import split_batch
from cfp.schedules.actions import KeptBytes, global_order
from cfp.schedules.registry import SCHEDULES, ScheduleName
from cfp.schedules.simulate import ActionCosts
from test_properties_schedules import assert_valid, peaks, replay

STEPS_PAST = list(range(1, 13)) + [99, 100, 101]


def test_checkpoint_steps_past_9_and_99(tmp_path):
    order = [5, 12, 1, 101, 10, 2, 99, 3, 11, 4, 100, 6, 9, 7, 8]      # saved out of order
    assert sorted(order) == STEPS_PAST
    for s in order:
        save_checkpoint(tmp_path / "all", s, {"x": np.full(3, s, np.int32)}, {"step": s})
    assert all_steps(tmp_path / "all") == STEPS_PAST
    assert latest_step(tmp_path / "all") == 101
    state, meta = restore_checkpoint(tmp_path / "all")
    assert meta == {"step": 101} and state["x"].tolist() == [101] * 3
    for s in (9, 10, 99, 100):
        state, meta = restore_checkpoint(tmp_path / "all", step=s)
        assert meta == {"step": s} and state["x"].tolist() == [s] * 3
    for s in range(7, 13):                       # retention across the digit: the newest by number
        save_checkpoint(tmp_path / "keep", s, {"x": np.full(1, s)}, keep=3)
    assert all_steps(tmp_path / "keep") == [10, 11, 12]
    assert latest_step(tmp_path / "keep") == 12


def test_twelve_pipelines_get_their_own_rows_and_order():
    batch_sizes = [3, 11, 2, 10, 1, 4, 12, 5, 10, 2, 6, 11]
    chunks = [3, 11, 1, 10, 1, 2, 12, 5, 5, 1, 3, 11]
    n = len(batch_sizes)
    layout = Layout.from_lists([[1]] * n, [[2]] * n, batch_sizes, chunks)
    assert len(layout.pipelines) == 12
    rows = sum(batch_sizes)
    batch = {"row": np.arange(rows), "x": np.arange(rows * 2).reshape(rows, 2)}
    got = split_batch(layout, batch)
    offset = 0
    for q, (size, k) in enumerate(zip(batch_sizes, chunks)):
        mb = size // k
        assert [list(m["row"]) for m in got[q]] == [list(range(offset + i * mb, offset + (i + 1) * mb))
                                                   for i in range(k)], f"pipeline {q}"
        offset += size
    tables = [SCHEDULES[ScheduleName.ONE_F_ONE_B].pattern(1 + q % 3, k) for q, k in enumerate(chunks)]
    order = global_order(tables)
    assert len(order) == sum(sum(map(len, t.actions)) for t in tables)
    for q, t in enumerate(tables):
        for d, row in enumerate(t.actions):
            mine = [(g.phase, g.microbatch, g.vstage) for g in order if (g.pipeline, g.stage) == (q, d)]
            assert mine == [(a.phase, a.microbatch, a.vstage) for a in row], f"pipeline {q} stage {d}"


@pytest.mark.parametrize("m", [100, 120])
@pytest.mark.parametrize("name", [ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1,
                                  ScheduleName.INTERLEAVED])
def test_patterns_with_a_hundred_micro_batches(name, m):
    entry = SCHEDULES[name]
    for p in (1, 4):
        v = entry.default_v
        table = entry.pattern(p, m, v)
        assert_valid(table, entry.placement.stages(p, v), m, entry.split)
        if name in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B):
            f, b = 1.0, 2.0
            span = replay(table, ActionCosts((f,) * p, (b,) * p, (0.0,) * p))
            assert abs(span - (m + p - 1) * (f + b)) < 1e-9 * span
            # what a stage keeps: GPipe every micro-batch, 1F1B at most p - s (its warm-up and one more)
            most = [m if name is ScheduleName.GPIPE else min(p - s, m) for s in range(p)]
            assert peaks(table, KeptBytes((1.0,) * p, (1.0,) * p)) == most


@pytest.mark.slow
def test_a_hundred_micro_batches_train_like_one_device():
    """12 residual tanh layers on two stages (7 + 5), 100 micro-batches of one row each, 1F1B: the parameters
    after 2 AdamW steps match the model's own loss and optax on one device (normwise; measured 2.2e-8; the bound
    1e-5 as the other runtime tests)."""
    from cfp.layered.model import LayeredModel
    from cfp.runtime.engine import HeteroTrainer
    from cfp.runtime.verify import replay as one_device
    L, D, V, S, M = 12, 8, 16, 4, 100
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"first": {"t": jax.random.normal(k[0], (V, D))},
              "layers": {"w": jax.random.normal(k[1], (L, D, D)) / np.sqrt(D)},
              "last": {"o": jax.random.normal(k[2], (D, V))}}

    def last(p, x, batch):
        ce = optax.softmax_cross_entropy_with_integer_labels(x @ p["o"], batch["y"])
        return jnp.sum(ce), jnp.float32(ce.size)
    model = LayeredModel(first=lambda p, b: p["t"][b["x"]], layer=lambda p, x: x + jnp.tanh(x @ p["w"]),
                         last=last, params=params)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.integers(0, V, (M, S)).astype(np.int32), "y": rng.integers(0, V, (M, S)).astype(np.int32)}
               for _ in range(2)]
    tx = optax.adamw(1e-2)
    trainer = HeteroTrainer(model, tx, Layout.from_lists([[1, 1]], [[7, 5]], [M], [M]), "1f1b",
                            example_batch=batches[0]).init()
    for b in batches:
        trainer.step(b)
    p = jax.tree_util.tree_map(np.asarray, model.params)
    _, want = one_device(model.loss, tx, p, tx.init(p), batches)
    got = trainer.state()[0]
    la, lb = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    err = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - b) ** 2) for a, b in zip(la, lb))
                  / sum(np.sum(np.asarray(b, np.float64) ** 2) for b in lb))
    moved = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - b) ** 2) for a, b in zip(jax.tree_util.tree_leaves(p),
                                                                                       lb))
                    / sum(np.sum(np.asarray(b, np.float64) ** 2) for b in lb))
    print(f"100 micro-batches: normwise parameter error {err:.2g} (the steps moved them by {moved:.2g})")
    assert err < 1e-5 and moved > 1e-3
