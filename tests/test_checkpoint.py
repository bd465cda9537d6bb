import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cfp.errors import ConfigError
from cfp.runtime.checkpoint import all_steps, latest_step, restore_checkpoint, save_checkpoint


def _state(scale=1.0):
    params = {"w": jnp.arange(12.0).reshape(4, 3) * scale, "b": jnp.ones(3) * scale}
    return {"params": params, "opt": optax.adam(1e-3).init(params), "step": np.int32(7)}


def test_roundtrip_with_target_and_metadata(tmp_path):
    st = _state()
    save_checkpoint(tmp_path, 5, st, {"model": "gpt", "loss": 1.5})
    assert latest_step(tmp_path) == 5
    got, meta = restore_checkpoint(tmp_path, target=st)
    assert meta == {"model": "gpt", "loss": 1.5}
    assert jax.tree.structure(got) == jax.tree.structure(st)  # optax namedtuples come back
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(st)):
        assert isinstance(a, np.ndarray)
        np.testing.assert_array_equal(a, np.asarray(b))
    raw, _ = restore_checkpoint(tmp_path, step=5)  # without target: saved nested dicts
    np.testing.assert_array_equal(raw["params"]["w"], np.asarray(st["params"]["w"]))


def test_sharded_state_restores_onto_another_mesh(tmp_path):
    devs = np.array(jax.devices())
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(Mesh(devs.reshape(8), ("x",)), P("x")))
    save_checkpoint(tmp_path, 1, {"w": w})
    got, _ = restore_checkpoint(tmp_path, target={"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)})
    new = jax.device_put(got["w"], NamedSharding(Mesh(devs.reshape(2, 4), ("a", "b")), P("b", "a")))
    np.testing.assert_array_equal(np.asarray(new), np.arange(64.0).reshape(8, 8))


def test_keep_prunes_oldest(tmp_path):
    for s in range(4):
        save_checkpoint(tmp_path, s, {"x": np.full(2, s)}, keep=2)
    assert all_steps(tmp_path) == [2, 3]
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]
    assert restore_checkpoint(tmp_path, step=2)[0]["x"].tolist() == [2, 2]


def test_errors(tmp_path):
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        restore_checkpoint(tmp_path)
    save_checkpoint(tmp_path, 1, {"w": np.zeros((2, 2))})
    with pytest.raises(ConfigError, match="already exists"):
        save_checkpoint(tmp_path, 1, {"w": np.zeros((2, 2))})
    save_checkpoint(tmp_path, 1, {"w": np.ones((2, 2))}, overwrite=True)
    assert restore_checkpoint(tmp_path)[0]["w"].sum() == 4
    with pytest.raises(ConfigError, match="not found.*available: \\[1\\]"):
        restore_checkpoint(tmp_path, step=9)
    with pytest.raises(ConfigError, match="shape"):
        restore_checkpoint(tmp_path, target={"w": np.zeros((3, 2))})
    with pytest.raises(ConfigError, match="no leaf 'v'"):
        restore_checkpoint(tmp_path, target={"w": np.zeros((2, 2)), "v": np.zeros(1)})
    with pytest.raises(ConfigError, match="step=-1"):
        save_checkpoint(tmp_path, -1, {})


def test_partial_dirs_are_not_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": np.ones(3)})
    # leftovers of crashes: an orbax tmp dir, and a step dir without its commit marker
    os.makedirs(tmp_path / "2.orbax-checkpoint-tmp-123" / "state")
    os.makedirs(tmp_path / "3" / "state")
    assert latest_step(tmp_path) == 1
    np.testing.assert_array_equal(restore_checkpoint(tmp_path)[0]["w"], np.ones(3))
    save_checkpoint(tmp_path, 4, {"w": np.zeros(3)})  # next save cleans the tmp dir
    assert not (tmp_path / "2.orbax-checkpoint-tmp-123").exists() and latest_step(tmp_path) == 4


_CRASH_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np
    from orbax.checkpoint._src.path import atomicity
    from cfp.runtime.checkpoint import save_checkpoint
    d, mode = sys.argv[1], sys.argv[2]
    save_checkpoint(d, 1, {"w": np.full(1000, 1.0)}, {"step": 1})
    if mode == "before_rename":  # everything written, killed just before the commit rename
        async def hang(self):
            print("FINALIZING", flush=True); time.sleep(600)
        atomicity.AtomicRenameTemporaryPath.finalize = hang
    print("SAVING", flush=True)
    save_checkpoint(d, 2, {"w": np.full(8_000_000, 2.0)}, {"step": 2})  # 64 MB: takes a while
    print("SAVED", flush=True)
""")


@pytest.mark.parametrize("mode", ["before_rename", "during_write"])
def test_kill_during_save_never_corrupts_latest(tmp_path, mode):
    d = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", _CRASH_SCRIPT, str(d), mode],
                            stdout=subprocess.PIPE, text=True)
    try:
        want = "FINALIZING" if mode == "before_rename" else "SAVING"
        for line in proc.stdout:
            if line.strip() == want:
                break
        if mode == "during_write":  # kill as soon as the tmp dir of step 2 appears
            deadline = time.time() + 30
            while time.time() < deadline and not any(n.startswith("2.") for n in os.listdir(d)):
                time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    step = latest_step(d)
    if mode == "before_rename":
        assert step == 1 and any(n.startswith("2.orbax-checkpoint-tmp") for n in os.listdir(d))
    assert step in (1, 2)  # whichever it is, it must restore fully
    state, meta = restore_checkpoint(d)
    assert meta == {"step": step}
    np.testing.assert_array_equal(state["w"], np.full(1000 if step == 1 else 8_000_000, float(step)))
    save_checkpoint(d, 3, {"w": np.zeros(2)})
    assert latest_step(d) == 3 and not any("tmp" in n for n in os.listdir(d))


# ----------------------------------------------------------------------------- integrity


def _saved(tmp_path):
    w = np.random.RandomState(0).randn(5000).astype(np.float32)  # one chunk of ~20 KB
    save_checkpoint(tmp_path, 1, {"w": w, "b": np.ones(3)}, {"note": "x"})
    return tmp_path / "1"


def _largest_file(root):
    files = [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs]
    return max(files, key=os.path.getsize)


def _one_line_error(tmp_path, match):
    with pytest.raises(ConfigError, match=match) as e:
        restore_checkpoint(tmp_path)
    assert "\n" not in str(e.value) and "step 1" in str(e.value)


def test_flipped_data_chunk_is_refused(tmp_path):
    chunk = _largest_file(_saved(tmp_path) / "state")
    data = bytearray(open(chunk, "rb").read())
    data[4096:8192] = bytes(b ^ 0xFF for b in data[4096:8192])  # a flipped 4 KB block
    open(chunk, "wb").write(bytes(data))
    _one_line_error(tmp_path, "cannot be read|does not match")


def test_checksum_mismatch_names_the_leaf(tmp_path):
    path = _saved(tmp_path) / "checksums" / "metadata"
    sums = json.loads(path.read_text())
    sums["w"] = "0" * 64  # as if the data had changed after writing
    path.write_text(json.dumps(sums))
    _one_line_error(tmp_path, "is corrupt: leaf 'w' does not match the checksum")


@pytest.mark.parametrize("part", ["chunk", "_METADATA", "metadata"])
def test_truncated_files_are_refused(tmp_path, part):
    ck = _saved(tmp_path)
    path = {"chunk": lambda: _largest_file(ck / "state"), "_METADATA": lambda: ck / "state" / "_METADATA",
            "metadata": lambda: ck / "metadata" / "metadata"}[part]()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    _one_line_error(tmp_path, "cannot be read")


def test_checkpoint_without_checksums_is_refused(tmp_path):
    import shutil
    shutil.rmtree(_saved(tmp_path) / "checksums")
    _one_line_error(tmp_path, "has no checksums")


def test_keep_is_orbax_retention_and_a_crash_while_pruning_leaves_whole_steps(tmp_path, monkeypatch):
    """A prune that dies half-way through deleting must never leave a `<step>` that looks complete but has
    lost data: orbax renames the old step out of the way first (todelete_subdir), then it is deleted."""
    import shutil
    for s in range(3):
        save_checkpoint(tmp_path, s, {"x": np.full(2, s)}, keep=3)
    real = shutil.rmtree

    def dies_half_way(path, *a, **k):  # deletes the data of one step, then the process "crashes"
        for root, dirs, _ in os.walk(path):
            if "state" in dirs:
                real(os.path.join(root, "state"))
                break
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, "rmtree", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, {"x": np.full(2, 3)}, keep=2)
    monkeypatch.setattr(shutil, "rmtree", real)
    assert all_steps(tmp_path)[-2:] == [2, 3]
    for s in all_steps(tmp_path):  # every step still listed restores whole
        assert restore_checkpoint(tmp_path, step=s)[0]["x"].tolist() == [s, s]
    save_checkpoint(tmp_path, 4, {"x": np.full(2, 4)}, keep=2)  # the next save cleans up
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]
