"""`cfp train` under the cluster's own launchers, for real: Debian's Open MPI (`mpirun -np 2`) and a single-node
Slurm (`srun -n 2`; `make launchers` installs both and starts munged, slurmctld and slurmd:
scripts/cluster-launchers.sh).
Per launcher: a two-pipeline layout whose every stage hop crosses the two processes trains as one job of 2
processes (the header says so) and verifies against one device; rank 1 SIGKILLed once checkpoint 2 is saved
ends the job non-zero within the heartbeat timeout, the launcher naming the rank; the relaunch resumes from the
newest checkpoint and gives the uninterrupted run's losses bit for bit. A launcher that is missing or not running skips
with that reason. Slow (each run starts 2 processes that compile): `make test-rest`."""
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

pytestmark = pytest.mark.slow

CFP = [sys.executable, "-m", "cfp.cli.main"]
# devices 0-3 are process 0's, 4-7 process 1's: both pipelines cross the processes at every stage hop
TRAIN = ["train", "--model", "llama2", "--num-layers", "3", "--seq-len", "16", "--hetero-configs",
         "[[2,1,1],[2,1,1]]", "--layer-partitions", "[[1,1,1],[1,1,1]]", "--devices-id",
         "[[[0,1],[4],[2]],[[5,6],[3],[7]]]", "--global-batch-size", "6", "2", "--chunks", "3", "1"]
STEP = re.compile(r"^step (\d+) loss ([0-9.]+)", re.M)
HEARTBEAT_S = 10
REFERENCE_STEPS = 5


def _slurm_reason():
    if not shutil.which("srun"):
        return "no srun: Debian's slurm-wlm is not installed (make launchers installs it)"
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if r.returncode != 0 or not {"idle", "mixed", "allocated"} & set(r.stdout.split()):
        return f"Slurm is not running here (make launchers starts it): sinfo: {(r.stderr or r.stdout).strip()[:200]}"
    return None


def _mpirun_reason():
    return None if shutil.which("mpirun") else "no mpirun: Debian's openmpi-bin is not installed (make launchers)"


LAUNCHERS = {
    # the environment goes to the ranks with -x (mpirun) and --export (srun): the documented way
    "mpirun": (_mpirun_reason, lambda env: ["mpirun", "--allow-run-as-root", "-np", "2"]
               + [a for k in env for a in ("-x", k)], "OMPI_COMM_WORLD_RANK",
               re.compile(r"process rank 1 with PID \d+ on node \S+ exited on signal 9")),
    "srun": (_slurm_reason, lambda env: ["srun", "-n", "2", "--kill-on-bad-exit=1", "--export=ALL"],
             "SLURM_PROCID", re.compile(r"srun: error: \S+: task 1: Killed")),
}


def _env(tag: str) -> dict:
    return {"CFP_DEVICES_PER_PROC": "4", "JAX_PLATFORMS": "cpu", "CFP_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S),
            "PYTHONUNBUFFERED": "1", "CFP_TEST_TAG": tag}


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in STEP.finditer(text)}


def _rank_pid(rank_var: str, tag: str):
    """The pid of the rank-1 process of the job tagged `tag` (its environment says so), or None."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                python = b"cfp.cli.main" in f.read()
        except OSError:
            continue
        if python and env.get(b"CFP_TEST_TAG") == tag.encode() and env.get(rank_var.encode()) == b"1":
            return int(entry)
    return None


@pytest.fixture(params=list(LAUNCHERS))
def launcher(request):
    reason, command, rank_var, killed = LAUNCHERS[request.param]
    why = reason()
    if why:
        pytest.skip(why)
    return request.param, command, rank_var, killed


def _run(command, args, tag, timeout=600):
    env = dict(os.environ, **_env(tag))
    env.pop("XLA_FLAGS", None)      # the device count comes from CFP_DEVICES_PER_PROC
    return subprocess.run(command(_env(tag)) + CFP + TRAIN + args, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _drain(stream, lines: list) -> None:
    for line in iter(stream.readline, ""):       # keep the pipe empty: a rank blocked on a full pipe would hang
        lines.append(line)


def _killed_run(command, rank_var: str, ckpt) -> tuple[int, str, float, int]:
    """A long run whose rank 1 is SIGKILLed once checkpoint 2 is saved: (exit code, output, seconds from the kill
    to the job's end, the newest checkpoint's step)."""
    from cfp.runtime.checkpoint import latest_step
    tag = uuid.uuid4().hex
    env = dict(os.environ, **_env(tag))
    env.pop("XLA_FLAGS", None)
    args = ["--steps", "100000", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    p = subprocess.Popen(command(_env(tag)) + CFP + TRAIN + args, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=_drain, args=(p.stdout, lines), daemon=True)
    reader.start()
    try:
        guard = time.monotonic() + 400     # a guard against a hang only: waits while the run lives
        while (latest_step(ckpt) or 0) < 2 and p.poll() is None and time.monotonic() < guard:
            time.sleep(0.02)
        pid = _rank_pid(rank_var, tag)
        assert pid is not None and p.poll() is None, "".join(lines)[-3000:]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        p.wait(timeout=HEARTBEAT_S + 120)     # a hang raises TimeoutExpired: a failure
        took = time.monotonic() - killed_at
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=10)
    return p.returncode, "".join(lines), took, latest_step(ckpt)


def test_launcher_trains_verifies_fails_cleanly_and_resumes(launcher, tmp_path):
    name, command, rank_var, killed = launcher
    # one job of 2 processes, verified; its losses the reference of the resumed run below
    full = _run(command, ["--steps", str(REFERENCE_STEPS), "--verify"], uuid.uuid4().hex)
    out = full.stdout + full.stderr
    assert full.returncode == 0, out[-4000:]
    assert "one job of 2 processes x 4 devices, joined through" in out and "; 2 process(es), 8 devices" in out
    assert re.search(rf"verify: max relative error \S+ over {REFERENCE_STEPS} steps \(ok", out), out[-3000:]
    reference = _losses(full.stdout)
    assert sorted(reference) == list(range(1, REFERENCE_STEPS + 1))

    # rank 1 SIGKILLed once checkpoint 2 is saved: the job ends non-zero, the launcher naming rank 1
    ckpt = tmp_path / "ckpt"
    code, rest, took, saved = _killed_run(command, rank_var, ckpt)
    assert code != 0
    assert killed.search(rest), rest[-3000:]
    print(f"{name}: the job ended {took:.1f} s after rank 1 was killed (measured; heartbeat timeout "
          f"{HEARTBEAT_S} s)")
    assert took < HEARTBEAT_S + 60, took
    assert 2 <= saved <= REFERENCE_STEPS - 1, saved      # steps take >= 0.2 s; the kill follows within 0.05 s

    # the relaunch resumes from the newest checkpoint and gives the uninterrupted run's losses, bit for bit
    args = ["--steps", str(REFERENCE_STEPS), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--resume"]
    resumed = _run(command, args, uuid.uuid4().hex)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    losses = _losses(resumed.stdout)
    assert sorted(losses) == list(range(saved + 1, REFERENCE_STEPS + 1))
    assert re.search(rf"resumed from \S+ step {saved}\b", resumed.stdout), resumed.stdout[-2000:]
    assert losses == {k: reference[k] for k in losses}


def _data_mix(tmp_path) -> str:
    """A mix JSON of three pipelines on the job's 8 devices: (1,2,1) on 0-1, (1,2,2) on 2-5 (its stages on either
    process), (1,2,1) on 6-7; their fits from the cost model (`cfp data schemes --gpu`: nothing measured)."""
    import json

    from cfp.cli.main import main
    space = tmp_path / "space.json"
    assert main(["data", "schemes", "--model", "llama2", "--config", "tiny", "--gpu", "A100-SXM-80G",
                 "--max-devices", "8", "--max-seq-len", "128", "--out", str(space)]) == 0
    fits = {(s["cp"], s["tp"], s["pp"]): s for s in json.loads(space.read_text())["schemes"]}
    keys = ("cp", "tp", "pp", "a", "b", "c", "max_len", "form")
    group = lambda shape: {"scheme": {k: fits[shape][k] for k in keys}, "pipelines": 1, "min_len": 0, "max_len": 127}
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"estimated_step_s": 1e-6, "devices": 8,
                               "groups": [group((1, 2, 1)), group((1, 2, 2)), group((1, 2, 1))]}))
    return str(mix)


@pytest.mark.parametrize("launcher", ["mpirun"], indirect=True)
def test_launcher_runs_cfp_data_train_as_one_job(launcher, tmp_path):
    """`cfp data train` joins the launcher's job as `cfp train` does (maybe_initialize_distributed): a mix on 8
    devices that neither 4-device process could run alone trains as one job of 2 processes and verifies against
    one device (each sequence alone), both processes reporting the same losses. Under mpirun only: the join is
    the one function `cfp train`'s test above runs under both launchers (a minute of CI saved)."""
    name, command, _, _ = launcher
    docs = tmp_path / "docs"
    docs.mkdir()
    rng = __import__("numpy").random.default_rng(0)
    for i, n in enumerate((30, 60, 90, 120, 45, 70, 20, 100, 80, 50)):
        (docs / f"{i}.txt").write_text("".join(chr(c) for c in rng.integers(97, 123, n)))
    argv = ["data", "train", "--model", "llama2", "--config", "tiny", "--input", str(docs), "--max-seq-len", "128",
            "--tokens-per-step", "400", "--steps", "2", "--mixes", _data_mix(tmp_path), "--verify"]
    tag = uuid.uuid4().hex
    # no rank is killed here: JAX's default-like heartbeat, so a loaded host's slow rank is not taken for dead
    ranks_env = dict(_env(tag), CFP_HEARTBEAT_TIMEOUT="60")
    env = dict(os.environ, **ranks_env)
    env.pop("XLA_FLAGS", None)
    # each rank's output in its own file (mpirun's --output-filename): mpirun forwards both ranks' lines into one
    # stream, where a line of one rank was once cut by the other's (CI, 2026-12-06)
    ranks = tmp_path / "ranks"
    cmd = command(ranks_env)
    r = subprocess.run(cmd[:1] + ["--output-filename", str(ranks)] + cmd[1:] + CFP + argv, env=env,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "one job of 2 processes x 4 devices, joined through" in out, out[-3000:]
    per_rank = [(ranks / "1" / f"rank.{k}" / "stdout").read_text() for k in (0, 1)]
    losses = [dict(re.findall(r"^step (\d): mix 0 \S.* loss ([0-9.]+) ", text, re.M)) for text in per_rank]
    assert losses[0] == losses[1] and sorted(losses[0]) == ["1", "2"], losses
    for text in per_rank:
        assert len(re.findall(r"verify: max relative error \S+ over 2 steps \(ok", text)) == 1, text[-3000:]
