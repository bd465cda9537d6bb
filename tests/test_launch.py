import io
import subprocess
import sys
import textwrap

import pytest

from cfp.errors import ConfigError
from cfp.runtime.launch import launch, maybe_initialize_distributed, whole_lines, xla_flags_with_device_count

WORKER = textwrap.dedent("""
    import sys
    from cfp.runtime.launch import maybe_initialize_distributed
    pid, n = maybe_initialize_distributed()   # before any device use
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cfp.runtime.comm import move
    from cfp.runtime.checkpoint import save_checkpoint, restore_checkpoint
    assert (n, jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 2, 8, 4)

    # cross-process sum over a mesh of all 8 devices: each process contributes its 4 rows
    mesh = Mesh(np.array(jax.devices()), ("x",))
    local = np.arange(4, dtype=np.float32) + 4 * pid
    g = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
    total = float(jax.jit(jnp.sum)(g))
    assert total == 28.0, total

    # a jit on this process's devices only (the other process does not take part)
    lmesh = Mesh(np.array(jax.local_devices()), ("y",))
    la = jax.device_put(np.arange(8.0), NamedSharding(lmesh, P("y")))
    assert float(jax.jit(lambda a: (a * (pid + 1)).sum())(la)) == 28.0 * (pid + 1)

    # point-to-point (the engine's stage-to-stage move): a tree sharded over process 0's devices
    # arrives on process 1's devices with another sharding, and back
    devs = np.array(jax.devices())
    m0, m1 = Mesh(devs[:4].reshape(2, 2), ("a", "b")), Mesh(devs[4:].reshape(4), ("x",))
    s0, s1 = NamedSharding(m0, P("a", None)), NamedSharding(m1, P("x", None))
    want = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.arange(3, dtype=np.int32)}
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), want)
    sh1 = {"w": s1, "b": NamedSharding(m1, P())}
    x = jax.device_put(want, {"w": s0, "b": NamedSharding(m0, P())}) if pid == 0 else None
    y = move(x, list(m0.devices.flat), list(m1.devices.flat), sh1, like)
    if pid == 1:
        assert y["w"].sharding == s1 and y["w"].is_fully_addressable
        np.testing.assert_array_equal(np.asarray(y["w"]), want["w"])
        np.testing.assert_array_equal(np.asarray(y["b"]), want["b"])
        back = jax.tree.map(lambda v: v * 2, y)
    else:
        assert y is None
        back = None
    z = move(back, list(m1.devices.flat), list(m0.devices.flat),
             {"w": s0, "b": NamedSharding(m0, P())}, like)
    if pid == 0:
        np.testing.assert_array_equal(np.asarray(z["w"]), want["w"] * 2)
        assert z["w"].sharding == s0

    # process-local checkpoints in a multi-process run (no cross-process barriers)
    d = f"{sys.argv[1]}/proc{pid}"
    save_checkpoint(d, 1, {"w": np.full(3, pid)}, {"pid": pid})
    st, meta = restore_checkpoint(d)
    assert meta == {"pid": pid} and st["w"].tolist() == [pid] * 3
    print(f"OK rank {pid} sum={total}", flush=True)
""")

FAILER = textwrap.dedent("""
    import sys, time
    from cfp.runtime.launch import maybe_initialize_distributed
    pid, n = maybe_initialize_distributed()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    if pid == 1:
        if sys.argv[1] == "exit":
            print("rank 1 giving up", flush=True)
            sys.exit(3)
        time.sleep(3600)  # hang
    mesh = Mesh(np.array(jax.devices()), ("x",))  # rank 0 waits in a collective for rank 1
    g = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(2, np.float32))
    print(float(jax.jit(jnp.sum)(g)))
""")


def test_two_processes_collectives_transfer_checkpoint(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    r = subprocess.run([sys.executable, "-m", "cfp.cli.main", "launch", "--nprocs", "2", "--devices-per-proc", "4",
                        "--timeout", "120", "--", sys.executable, str(script), str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[rank 0] OK rank 0 sum=28.0" in r.stdout and "[rank 1] OK rank 1 sum=28.0" in r.stdout


def _launch(tmp_path, script_text, *args, **kw):
    script = tmp_path / "s.py"
    script.write_text(script_text)
    out, err = io.StringIO(), io.StringIO()
    code = launch([sys.executable, str(script), *args], 2, 2, out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def test_failing_rank_stops_the_others(tmp_path):
    # rank 0 is blocked in a collective waiting for rank 1: the launcher must stop it (the message
    # says so) rather than wait for it; a hang would end in the timeout's code 124 instead
    code, out, err = _launch(tmp_path, FAILER, "exit", timeout=120)
    assert code == 3
    assert "[rank 1] rank 1 giving up" in out
    assert "[rank 1] cfp: process 1 of 2 failed (exit code 3)" in out      # the rank names itself
    assert err.strip().splitlines()[-1] == "cfp launch: rank 1 exited with code 3; stopped 1 other rank(s)"


def test_hanging_rank_hits_timeout(tmp_path):
    code, out, err = _launch(tmp_path, FAILER, "hang", timeout=4)
    assert code == 124
    assert err.strip().splitlines()[-1] == ("cfp launch: timeout after 4 s; ranks [0, 1] were still "
                                            "running and were stopped")


def test_per_rank_logs_and_env(tmp_path):
    code, out, err = _launch(
        tmp_path, "import os; print(os.environ['CFP_PROCESS_ID'], os.environ['CFP_NUM_PROCESSES'], "
                  "os.environ['CFP_DEVICES_PER_PROC'], os.environ['CFP_COORDINATOR'].startswith('127.0.0.1:'))",
        log_dir=str(tmp_path / "logs"))
    assert code == 0 and "[rank 0] 0 2 2 True" in out and "[rank 1] 1 2 2 True" in out
    assert (tmp_path / "logs" / "rank1.log").read_text() == "1 2 2 True\n"


def test_killed_rank_is_named(tmp_path):
    code, out, err = _launch(tmp_path, "import os, signal, time\n"
                                "if os.environ['CFP_PROCESS_ID'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
                                "time.sleep(60)", timeout=30)
    assert code == 128 + 9 and "rank 0 was killed by SIGKILL; stopped 1 other rank(s)" in err


def test_bad_arguments(capsys):
    with pytest.raises(ConfigError, match="no command"):
        launch([], 2)
    with pytest.raises(ConfigError, match="nprocs=0"):
        launch(["true"], 0)
    with pytest.raises(ConfigError, match="do not fit num_processes=2"):
        launch(["true"], 2, first_rank=1, num_processes=2)
    with pytest.raises(ConfigError, match="cannot start command"):
        launch(["/nonexistent/cmd"], 1)
    with pytest.raises(ConfigError, match="timeout=nan"):
        launch(["true"], 1, timeout=float("nan"))
    with pytest.raises(ConfigError, match="either --coordinator"):
        launch(["true"], 1, port=1234, coordinator="h:1")
    from cfp.cli.main import main
    for argv, message in ((["--nprocs", "2"], "no command to launch"),
                          (["--nprocs", "0", "--", "true"], "argument --nprocs: 0 must be a positive integer "
                                                            "(1 or more)"),
                          (["--nprocs", "1", "--timeout", "nan", "--", "true"],
                           "argument --timeout: nan must be a finite number > 0")):
        code = main(["launch", *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("cfp launch: error: ") and message in err
        assert err.count("\n") == 1


def test_single_process_defaults(monkeypatch):
    monkeypatch.delenv("CFP_COORDINATOR", raising=False)
    assert maybe_initialize_distributed() == (0, 1)
    assert xla_flags_with_device_count("--a --xla_force_host_platform_device_count=8", 4) == \
        "--a --xla_force_host_platform_device_count=4"


def test_move_within_one_process():
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from cfp.runtime.comm import move

    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4].reshape(2, 2), ("a", "b")), P("a", "b"))
    dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x"))  # same process: any sharding works
    x = jax.device_put(np.arange(32.0).reshape(4, 8), src)
    y = move(x, list(devs[:4]), list(devs[4:]), dst, jax.ShapeDtypeStruct((4, 8), np.float32))
    assert y.sharding == dst
    np.testing.assert_array_equal(np.asarray(y), np.arange(32.0).reshape(4, 8))


def test_initialize_refuses_late_or_bad_env(monkeypatch):
    import jax

    from cfp.errors import CfpError

    jax.devices()  # this test process has started its backend already
    monkeypatch.setenv("CFP_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("CFP_NUM_PROCESSES", "2")
    monkeypatch.setenv("CFP_PROCESS_ID", "5")
    with pytest.raises(ConfigError, match="CFP_PROCESS_ID=5"):
        maybe_initialize_distributed()
    monkeypatch.setenv("CFP_PROCESS_ID", "1")
    for bad in ("0", "ten", "2.5"):
        monkeypatch.setenv("CFP_HEARTBEAT_TIMEOUT", bad)
        with pytest.raises(ConfigError, match=f"CFP_HEARTBEAT_TIMEOUT='{bad}' must be a whole number of seconds"):
            maybe_initialize_distributed()
    monkeypatch.delenv("CFP_HEARTBEAT_TIMEOUT")
    with pytest.raises(CfpError, match="after JAX devices were used"):
        maybe_initialize_distributed()


TRAIN = ["train", "--model", "llama2", "--num-layers", "4", "--hetero-configs", "[[2,1,1],[4]]"]  # 8 devices


@pytest.mark.parametrize("launcher, cmd, message", [
    (["--nprocs", "3", "--devices-per-proc", "4"], ["cfp"],
     "the layout uses 8 devices (ids 0-7) but the job has 12, 3 processes x 4 devices each: process(es) [2] "
     "would hold none of them and sit idle; launch 2 processes (--nprocs 2 --devices-per-proc 4)"),
    (["--nprocs", "2", "--devices-per-proc", "2"], [sys.executable, "-m", "cfp.cli.main"],
     "the layout uses device 7 but the job has 4 devices, 2 processes x 2 devices each; launch 4 processes "
     "(--nprocs 4 --devices-per-proc 2)"),
    (["--nprocs", "2", "--devices-per-proc", "4"], ["cfp"], None),
])
def test_launch_refuses_a_train_layout_that_leaves_a_rank_idle(capsys, monkeypatch, launcher, cmd, message):
    """Checked before any rank starts: one line, exit 2, naming the layout's devices, the job's and a fix."""
    import cfp.runtime.launch as rl
    from cfp.cli.main import main
    monkeypatch.setattr(rl, "launch", lambda *a, **k: 0)    # a layout that fits goes on to start the ranks
    code = main(["launch", *launcher, "--", *cmd, *TRAIN])
    err = capsys.readouterr().err
    if message is None:
        assert code == 0 and err == ""
    else:
        assert code == 2 and err == f"cfp launch: error: {message}\n"


def test_train_rank_refuses_a_job_that_leaves_a_rank_idle(monkeypatch):
    """The same rule inside each rank (hand-set CFP_* variables, several hosts)."""
    from cfp.runtime.launch import check_layout_fills_processes
    check_layout_fills_processes(range(8))                  # no CFP_COORDINATOR: a single process
    monkeypatch.setenv("CFP_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("CFP_NUM_PROCESSES", "2")
    monkeypatch.setenv("CFP_DEVICES_PER_PROC", "4")
    check_layout_fills_processes(range(8))
    with pytest.raises(ConfigError, match=r"process\(es\) \[1\] would hold none"):
        check_layout_fills_processes([0, 1, 2])
    with pytest.raises(ConfigError, match="renumber the layout's devices"):
        monkeypatch.setenv("CFP_NUM_PROCESSES", "3")
        check_layout_fills_processes([0, 1, 8, 9])


# ---- the cluster's own launchers (cfp.runtime.launchers): the variables srun, mpirun and a Kubernetes indexed Job
# set, as each sets them for the second process of a job of 4 on a node running 2 of them
SRUN = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4", "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1"}
MPIRUN = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
JOBSET = {"KUBERNETES_SERVICE_HOST": "10.0.0.9", "JOB_COMPLETION_INDEX": "3"}


@pytest.mark.parametrize("env, name, size", [(SRUN, "slurm", 4), (MPIRUN, "ompi", 4), (JOBSET, "", None)],
                         ids=["srun", "mpirun", "jobset"])
def test_a_launchers_job_is_detected(env, name, size):
    from cfp.runtime.launchers import detect_job
    job = detect_job(env)
    assert (job.launcher.name, job.process_id, job.num_processes) == (name, 3, size)
    assert job.local_rank == (0 if env is JOBSET else 1)


def test_launcher_job_arguments(monkeypatch):
    """The job handed to jax.distributed.initialize: process 3 of 4, its 4 devices the second block of its node's
    (local rank 1), the coordinator left to JAX's detection of that launcher."""
    from cfp.runtime.launch import _launcher_job
    from cfp.runtime.launchers import detect_job
    for env, method in ((SRUN, "slurm"), (MPIRUN, "ompi"), (JOBSET, None)):
        monkeypatch.setattr("os.environ", dict(env, CFP_DEVICES_PER_PROC="4"))
        pid, d, args = _launcher_job(detect_job(env))
        local = [0, 1, 2, 3] if env is JOBSET else [4, 5, 6, 7]
        assert (pid, d) == (3, 4) and args == dict(num_processes=None if env is JOBSET else 4, process_id=3,
                                                   local_device_ids=local, cluster_detection_method=method)


def test_no_launcher_or_one_process_is_a_single_process_run():
    from cfp.runtime.launchers import detect_job
    assert detect_job({}) is None
    assert detect_job({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"}) is None     # an sbatch script, outside srun
    assert detect_job(dict(SRUN, SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0")) is None
    assert detect_job({"KUBERNETES_SERVICE_HOST": "10.0.0.9"}) is None        # a pod, not an indexed Job


def test_local_device_ids_and_devices_per_process():
    """jax#16788: JAX's default is one device per process, the local rank's; cfp gives each its block of
    CFP_DEVICES_PER_PROC devices, or all it sees where the launcher bound exactly that many to it."""
    from cfp.runtime.launchers import detect_job, devices_per_process, local_device_ids
    job = detect_job(SRUN)
    assert local_device_ids(job, 2, {}) == [2, 3]
    assert local_device_ids(job, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) == [4, 5, 6, 7]
    assert local_device_ids(job, 2, {"CUDA_VISIBLE_DEVICES": "6,7"}) == [0, 1]       # --gpus-per-task 2
    assert local_device_ids(detect_job(dict(SRUN, SLURM_LOCALID="0")), 1, {}) == [0]
    assert devices_per_process({"CFP_DEVICES_PER_PROC": "4",
                                "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}) == 4
    assert devices_per_process({"XLA_FLAGS": "--a --xla_force_host_platform_device_count=2"}) == 2
    assert devices_per_process({}) == 1
    for bad in ("0", "four", "-1"):
        with pytest.raises(ConfigError, match=f"CFP_DEVICES_PER_PROC='{bad}' must be a whole number of devices"):
            devices_per_process({"CFP_DEVICES_PER_PROC": bad})
    with pytest.raises(ConfigError, match=r"SLURM_PROCID='x' \(set by the launcher\) is not an integer"):
        detect_job(dict(SRUN, SLURM_PROCID="x"))
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4"):
        detect_job(dict(MPIRUN, OMPI_COMM_WORLD_RANK="4"))


def test_cfp_variables_override_the_launchers(monkeypatch):
    """CFP_COORDINATOR set: the CFP_* job, not the launcher's (the layout check reads the same)."""
    from cfp.runtime.launch import check_layout_fills_processes
    monkeypatch.setattr("os.environ", dict(SRUN, CFP_DEVICES_PER_PROC="2"))
    with pytest.raises(ConfigError, match=r"the job has 8 devices, 4 processes x 2 devices each"):
        check_layout_fills_processes(range(9))
    monkeypatch.setattr("os.environ", dict(SRUN, CFP_COORDINATOR="h:1", CFP_NUM_PROCESSES="2",
                                           CFP_DEVICES_PER_PROC="4"))
    check_layout_fills_processes(range(8))


def test_a_printed_line_reaches_the_launcher_in_one_write():
    """Under PYTHONUNBUFFERED `print` wrote a line's text and its newline apart, and mpirun put another rank's
    output between them (two ranks' step lines merged in `cfp data train`); `whole_lines` makes it one write."""
    class Raw(io.RawIOBase):
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)
    raw = Raw()
    out = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)     # stdout under PYTHONUNBUFFERED
    print("step 1: loss 6.26", file=out)
    assert raw.writes == [b"step 1: loss 6.26", b"\n"]
    raw.writes.clear()
    whole_lines([out, io.StringIO()])          # a stream that is not a TextIOWrapper is left as it is
    print("step 2: loss 6.15", file=out)
    print("partial", end="", file=out)
    assert raw.writes == [b"step 2: loss 6.15\n"]
    out.flush()
    assert raw.writes[-1] == b"partial"
