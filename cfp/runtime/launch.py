"""Multi-process launching: spawn N ranks of a command, and let each rank join a JAX distributed run.

Single host (what ``cfp launch`` does)::

    cfp launch --nprocs 2 --devices-per-proc 4 -- python train.py

starts 2 copies of the command with ``CFP_COORDINATOR=127.0.0.1:<port>``, ``CFP_NUM_PROCESSES``,
``CFP_PROCESS_ID`` and ``CFP_DEVICES_PER_PROC`` set, prefixes their output with ``[rank i]``, and if one
rank fails, stops the others and exits non-zero naming it. Each rank calls
:func:`maybe_initialize_distributed` first thing, **before any JAX device use** (``jax.devices()``, creating
an array, jit): it must set ``XLA_FLAGS`` before the CPU backend starts, and ``jax.distributed.initialize``
refuses to run after that anyway.

The cluster's own launcher (Slurm's ``srun``, Open MPI's ``mpirun``, a Kubernetes indexed Job/JobSet) works the
same without ``cfp launch``: :func:`maybe_initialize_distributed` finds the job in the launcher's variables
(`cfp.runtime.launchers`) and joins it through ``jax.distributed``'s cluster detection, e.g.::

    mpirun -np 2 -x CFP_DEVICES_PER_PROC=4 cfp train ...
    srun -n 2 --export=ALL,CFP_DEVICES_PER_PROC=4 cfp train ...

``CFP_DEVICES_PER_PROC`` is each process's device count (on CPU the simulated devices; on GPUs the ones it
drives, a block of its node's by local rank, or all it sees when the launcher bound exactly that many); without
it, the ``XLA_FLAGS`` device count, else 1. The ``CFP_*`` variables below, when set, override the launcher's.

Multi-host: run one launcher per host, all pointing at the coordinator (process 0's host), e.g. two hosts
with 2 ranks each::

    host A$ cfp launch --nprocs 2 --num-processes 4 --first-rank 0 --coordinator hostA:12345 -- cmd
    host B$ cfp launch --nprocs 2 --num-processes 4 --first-rank 2 --coordinator hostA:12345 -- cmd

or set the four ``CFP_*`` variables by hand for each process (``CFP_COORDINATOR=hostA:12345``, a distinct
``CFP_PROCESS_ID`` in ``[0, CFP_NUM_PROCESSES)``). The port must be reachable from every host; gloo also
opens connections between all hosts. A launcher only watches its own host's ranks, so a failure on
another host is noticed through JAX's heartbeat (``heartbeat_timeout_s``, default 30 s, or the
``CFP_HEARTBEAT_TIMEOUT`` variable's seconds) rather than immediately.
"""
from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from cfp.errors import CfpError, ConfigError

ENV_COORDINATOR = "CFP_COORDINATOR"
ENV_NUM_PROCESSES = "CFP_NUM_PROCESSES"
ENV_PROCESS_ID = "CFP_PROCESS_ID"
ENV_DEVICES_PER_PROC = "CFP_DEVICES_PER_PROC"
ENV_HEARTBEAT_TIMEOUT = "CFP_HEARTBEAT_TIMEOUT"   # optional: seconds before a silent peer fails the job

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def xla_flags_with_device_count(flags: str, count: int) -> str:
    """`flags` with the host-platform device count replaced by `count`."""
    return " ".join(_DEVICE_COUNT_FLAG.sub("", flags).split() + [f"--xla_force_host_platform_device_count={count}"])


def _hard_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not turn an exit into a hang
            pass
    os._exit(code)


def _install_fast_fail(pid: int, n: int) -> None:
    """Make an error exit skip JAX's atexit shutdown barrier, naming the failing process.

    The barrier waits (up to shutdown_timeout_s) for every process; after an error the peers are usually
    blocked in a collective waiting for this one, so it would only time out and delay the launcher's
    reaction. Covers uncaught exceptions and `sys.exit(nonzero)`; a bare `raise SystemExit(n)` still waits.
    """
    orig_hook, orig_exit = sys.excepthook, sys.exit

    def named(code: int) -> None:
        print(f"cfp: process {pid} of {n} failed (exit code {code})", file=sys.stderr)
        _hard_exit(code)

    def excepthook(tp, value, tb):
        orig_hook(tp, value, tb)
        named(130 if issubclass(tp, KeyboardInterrupt) else 1)

    def exit(code=None):
        if code is not None and code != 0:
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            named(int(code))
        orig_exit(code)

    sys.excepthook, sys.exit = excepthook, exit


def whole_lines(streams=None) -> None:
    """Make each line printed to ``streams`` (default stdout and stderr) one write. Under ``PYTHONUNBUFFERED`` (or
    ``python -u``, as JAX advises for distributed runs) ``print`` writes the text and its newline separately, and
    mpirun and srun forward each rank's writes as they come, so another rank's line could land between them: two
    ranks' lines merged into one (seen in `cfp data train` under mpirun, a step's line lost to a parser). Line
    buffering without write-through hands the whole line over at its newline."""
    for stream in streams if streams is not None else (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError):   # not a TextIOWrapper (e.g. a caller's capture): leave it as it is
            pass


def _heartbeat_timeout() -> int:
    """Seconds without a peer's heartbeat before the job fails: ``CFP_HEARTBEAT_TIMEOUT``, else 30."""
    raw = os.environ.get(ENV_HEARTBEAT_TIMEOUT, "30")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{ENV_HEARTBEAT_TIMEOUT}={raw!r} must be a whole number of seconds >= 1")
    return value


def maybe_initialize_distributed(init_timeout_s: int = 60, heartbeat_timeout_s: int | None = None,
                                 shutdown_timeout_s: int = 120, fast_fail: bool = True) -> tuple[int, int]:
    """Join the distributed run this process belongs to; returns (process_id, num_processes).

    The job comes from the ``CFP_*`` variables (``cfp launch``, or set by hand: the explicit override), else from
    the cluster's launcher (``srun``, ``mpirun``, a Kubernetes indexed Job: `cfp.runtime.launchers`), whose
    variables ``jax.distributed``'s cluster detection reads; each process drives ``CFP_DEVICES_PER_PROC``
    devices (on CPU, else the ``XLA_FLAGS`` device count, else 1). Neither: nothing is done and (0, 1) returned;
    if JAX is already initialised for distributed use it returns the current values. Must be called before any
    JAX device use (see module doc). The timeouts are shorter than JAX's (300 s) so a missing or dead peer ends
    the run sooner; the shutdown barrier timeout bounds how long a finished rank waits for slower ones (e.g. one
    still saving). fast_fail: install :func:`_install_fast_fail`, so a failing rank exits at once naming itself
    (don't use it if the program catches SystemExit from `sys.exit` on purpose).
    """
    import jax

    from cfp.runtime.launchers import detect_job
    coord = os.environ.get(ENV_COORDINATOR)
    job = None if coord else detect_job(os.environ)
    if not coord and job is None:
        return 0, 1
    if jax.distributed.is_initialized():
        return jax.process_index(), jax.process_count()
    pid, d, args = _explicit_job(coord) if coord else _launcher_job(job)
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = _heartbeat_timeout()
    from cfp.ir._jax_internals import backends_are_initialized

    if backends_are_initialized():
        raise CfpError("maybe_initialize_distributed() was called after JAX devices were used; call it "
                       "first thing in the program")
    os.environ["XLA_FLAGS"] = xla_flags_with_device_count(os.environ.get("XLA_FLAGS", ""), d)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
    jax.distributed.initialize(**args, initialization_timeout=init_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               shutdown_timeout_seconds=shutdown_timeout_s)
    pid, n = jax.process_index(), jax.process_count()
    whole_lines()
    if fast_fail:
        _install_fast_fail(pid, n)
    if jax.local_device_count() != d:  # e.g. a GPU backend, where the CPU device-count flag does nothing
        raise CfpError(f"rank {pid} has {jax.local_device_count()} local devices, expected "
                       f"{ENV_DEVICES_PER_PROC}={d} (set JAX_PLATFORMS=cpu to simulate devices)")
    if job is not None and pid == 0:
        print(f"one job of {n} processes x {d} devices, joined through {job.describe.split(' started by ')[1]}",
              flush=True)
    return pid, n


def _explicit_job(coord: str) -> tuple[int, int, dict]:
    """(process id, devices per process, jax.distributed.initialize's job arguments) from the ``CFP_*``
    variables."""
    try:
        n = int(os.environ[ENV_NUM_PROCESSES])
        pid = int(os.environ[ENV_PROCESS_ID])
        d = int(os.environ.get(ENV_DEVICES_PER_PROC, "1"))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{ENV_COORDINATOR} is set but {e} is missing or not an integer (need "
                          f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}, {ENV_DEVICES_PER_PROC})") from None
    if not (0 <= pid < n) or d < 1:
        raise ConfigError(f"{ENV_PROCESS_ID}={pid}, {ENV_NUM_PROCESSES}={n}, {ENV_DEVICES_PER_PROC}={d} are "
                          "invalid (need 0 <= id < num_processes and devices >= 1)")
    return pid, d, dict(coordinator_address=coord, num_processes=n, process_id=pid)


def _launcher_job(job) -> tuple[int, int, dict]:
    """The same from a cluster launcher's job: JAX's detection of that launcher finds the coordinator."""
    from cfp.runtime.launchers import devices_per_process, local_device_ids
    d = devices_per_process(os.environ)
    return job.process_id, d, dict(num_processes=job.num_processes, process_id=job.process_id,
                                   local_device_ids=local_device_ids(job, d, os.environ),
                                   cluster_detection_method=job.launcher.name or None)


def check_layout_fills_processes(device_ids, num_processes: int | None = None,
                                 devices_per_proc: int | None = None) -> None:
    """Refuse a multi-process job in which some process holds none of the layout's devices (it would sit
    idle) or a layout device lies beyond the job's devices. Process p holds the global device ids
    p*devices_per_proc .. (p+1)*devices_per_proc-1. Without arguments, the job is read from the ``CFP_*``
    variables or the cluster launcher's (a single-process run passes)."""
    if num_processes is None:
        num_processes, devices_per_proc = _job_shape()
        if num_processes is None:
            return
    ids = sorted(set(device_ids))
    total = num_processes * devices_per_proc
    job = f"{num_processes} processes x {devices_per_proc} devices each"
    need = -(-(ids[-1] + 1) // devices_per_proc)   # processes that the highest device id reaches
    fix = f"launch {need} process{'es' if need > 1 else ''} (--nprocs {need} --devices-per-proc {devices_per_proc})"
    if ids[-1] >= total:
        raise ConfigError(f"the layout uses device {ids[-1]} but the job has {total} devices, {job}; " + fix)
    idle = sorted(set(range(num_processes)) - {d // devices_per_proc for d in ids})
    if idle:
        raise ConfigError(f"the layout uses {len(ids)} devices (ids {_ranges(ids)}) but the job has {total}, "
                          f"{job}: process(es) {idle} would hold none of them and sit idle; "
                          + (fix if need < num_processes
                             else "renumber the layout's devices (--devices-id) so every process holds some"))


def _job_shape() -> tuple[int | None, int | None]:
    """(processes, devices per process) of the job the ``CFP_*`` or a launcher's variables describe; (None, None)
    for a single process or a job whose size only the cluster knows (maybe_initialize_distributed names a bad
    variable)."""
    from cfp.runtime.launchers import detect_job, devices_per_process
    try:
        if os.environ.get(ENV_COORDINATOR):
            return int(os.environ[ENV_NUM_PROCESSES]), int(os.environ.get(ENV_DEVICES_PER_PROC, "1"))
        job = detect_job(os.environ)
        if job is not None and job.num_processes is not None:
            return job.num_processes, devices_per_process(os.environ)
    except (KeyError, ValueError):   # ConfigError included
        pass
    return None, None


def _ranges(ids: list[int]) -> str:
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def _pump(stream, prefix: bytes, out: TextIO, lock: threading.Lock, log) -> None:
    # forward one rank's output line by line, so lines of different ranks never interleave mid-line
    for line in iter(stream.readline, b""):
        if log is not None:
            log.write(line)
            log.flush()
        text = (prefix + line).decode("utf-8", errors="replace")
        with lock:
            out.write(text if text.endswith("\n") else text + "\n")
            out.flush()
    stream.close()


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # each rank leads its own session: this reaches its children too
    except (ProcessLookupError, PermissionError):
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(command: Sequence[str], nprocs: int, devices_per_proc: int = 1, *, port: int | None = None,
           timeout: float | None = None, coordinator: str | None = None, num_processes: int | None = None,
           first_rank: int = 0, log_dir: str | None = None, grace_s: float = 2.0,
           out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run `nprocs` ranks of `command`; returns 0 if all succeed, else a non-zero code (124 on timeout).

    On the first failing rank (or the timeout) the other ranks get SIGTERM and, after `grace_s`, SIGKILL:
    JAX catches SIGTERM for preemption handling, so without the escalation a rank blocked in a collective
    would linger for minutes.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    total = _check_args(command, nprocs, devices_per_proc, port, timeout, coordinator, num_processes,
                        first_rank)
    if coordinator is None:
        coordinator = f"127.0.0.1:{port or free_port()}"
    if log_dir:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"log_dir={log_dir!r} cannot be created: {e.strerror}") from None
    ranks = _Ranks(out, log_dir)
    try:
        for i in range(nprocs):
            ranks.start(command, first_rank + i, _rank_env(coordinator, total, first_rank + i,
                                                           devices_per_proc))
        failure = ranks.wait(timeout)
    finally:
        stopped = ranks.stop(grace_s)
    return _report(failure, stopped, timeout, err)


def _check_args(command, nprocs, devices_per_proc, port, timeout, coordinator, num_processes,
                first_rank) -> int:
    """Validate launch's arguments; returns the total number of processes."""
    if not command:
        raise ConfigError("no command to launch (give it after '--', e.g. cfp launch --nprocs 2 -- python x.py)")
    for name, v in (("nprocs", nprocs), ("devices_per_proc", devices_per_proc)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} is invalid (must be a positive integer)")
    total = num_processes if num_processes is not None else nprocs
    if first_rank < 0 or first_rank + nprocs > total:
        raise ConfigError(f"ranks {first_rank}..{first_rank + nprocs - 1} do not fit num_processes={total}")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"timeout={timeout!r} is invalid (must be a finite number of seconds > 0)")
    if coordinator is not None and port is not None:
        raise ConfigError("give either --coordinator HOST:PORT or --port, not both")
    return total


def _rank_env(coordinator: str, total: int, rank: int, devices_per_proc: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(total),
                ENV_PROCESS_ID: str(rank), ENV_DEVICES_PER_PROC: str(devices_per_proc),
                "XLA_FLAGS": xla_flags_with_device_count(env.get("XLA_FLAGS", ""), devices_per_proc)})
    return env


class _Ranks:
    """The started ranks, their output pumps and log files."""

    def __init__(self, out: TextIO, log_dir: str | None):
        self.out, self.log_dir = out, log_dir
        self.lock = threading.Lock()
        self.procs: list[tuple[int, subprocess.Popen]] = []
        self.threads: list[threading.Thread] = []
        self.logs: list = []

    def start(self, command: Sequence[str], rank: int, env: dict) -> None:
        try:
            p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise ConfigError(f"cannot start command {command[0]!r}: {e.strerror}") from None
        self.procs.append((rank, p))
        log = open(os.path.join(self.log_dir, f"rank{rank}.log"), "wb") if self.log_dir else None
        self.logs.append(log)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {rank}] ".encode(), self.out,
                                                 self.lock, log), daemon=True)
        t.start()
        self.threads.append(t)

    def wait(self, timeout: float | None):
        """None when every rank exited 0, else (rank, code) of the first failure, or "timeout"."""
        start = time.monotonic()
        while True:
            codes = [(rank, p.poll()) for rank, p in self.procs]
            bad = [(rank, c) for rank, c in codes if c not in (None, 0)]
            if bad:
                return bad[0]
            if all(c == 0 for _, c in codes):
                return None
            if timeout is not None and time.monotonic() - start > timeout:
                return "timeout"
            time.sleep(0.05)

    def stop(self, grace_s: float) -> list[int]:
        """SIGTERM, then after ``grace_s`` SIGKILL, every rank still running; returns their ranks."""
        running = [(rank, p) for rank, p in self.procs if p.poll() is None]
        for _, p in running:
            _kill_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(p, signal.SIGKILL)
                p.wait()
        for t in self.threads:
            t.join(timeout=2.0)  # a grandchild that escaped the kill could hold the pipe open
        for log in self.logs:
            if log is not None:
                log.close()
        return [rank for rank, _ in running]


def _report(failure, stopped: list[int], timeout: float | None, err: TextIO) -> int:
    if failure is None:
        return 0
    if failure == "timeout":
        print(f"cfp launch: timeout after {timeout:g} s; ranks {stopped} were still running and were stopped",
              file=err, flush=True)
        return 124
    rank, code = failure
    also = f"; stopped {len(stopped)} other rank(s)" if stopped else ""
    print(f"cfp launch: rank {rank} {_describe(code)}{also}", file=err, flush=True)
    return code if code > 0 else 128 - code  # shell convention for death by signal
