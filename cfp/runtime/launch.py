"""Multi-process launching: spawn N ranks of a command, and let each rank join a JAX distributed run.

Single host (what ``cfp launch`` does)::

    cfp launch --nprocs 2 --devices-per-proc 4 -- python train.py

starts 2 copies of the command with ``CFP_COORDINATOR=127.0.0.1:<port>``, ``CFP_NUM_PROCESSES``,
``CFP_PROCESS_ID`` and ``CFP_DEVICES_PER_PROC`` set, prefixes their output with ``[rank i]``, and if one
rank fails, stops the others and exits non-zero naming it. Each rank calls
:func:`maybe_initialize_distributed` first thing, **before any JAX device use** (``jax.devices()``, creating
an array, jit): it must set ``XLA_FLAGS`` before the CPU backend starts, and ``jax.distributed.initialize``
refuses to run after that anyway.

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


def _install_fast_fail() -> None:
    """Make an error exit skip JAX's atexit shutdown barrier.

    The barrier waits (up to shutdown_timeout_s) for every process; after an error the peers are usually
    blocked in a collective waiting for this one, so it would only time out and delay the launcher's
    reaction. Covers uncaught exceptions and `sys.exit(nonzero)`; a bare `raise SystemExit(n)` still waits.
    """
    orig_hook, orig_exit = sys.excepthook, sys.exit

    def excepthook(tp, value, tb):
        orig_hook(tp, value, tb)
        _hard_exit(130 if issubclass(tp, KeyboardInterrupt) else 1)

    def exit(code=None):
        if code is not None and code != 0:
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            _hard_exit(int(code))
        orig_exit(code)

    sys.excepthook, sys.exit = excepthook, exit


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
    """Join the distributed run described by the ``CFP_*`` variables; returns (process_id, num_processes).

    Without ``CFP_COORDINATOR`` this does nothing and returns (0, 1); if JAX is already initialised for
    distributed use it returns the current values. Must be called before any JAX device use (see module doc).
    The timeouts are shorter than JAX's (300 s) so a missing or dead peer ends the run sooner; the shutdown
    barrier timeout bounds how long a finished rank waits for slower ones (e.g. one still saving).
    fast_fail: install :func:`_install_fast_fail`, so a failing rank exits at once (don't use it if the
    program catches SystemExit from `sys.exit` on purpose).
    """
    import jax

    coord = os.environ.get(ENV_COORDINATOR)
    if not coord:
        return 0, 1
    if jax.distributed.is_initialized():
        return jax.process_index(), jax.process_count()
    try:
        n = int(os.environ[ENV_NUM_PROCESSES])
        pid = int(os.environ[ENV_PROCESS_ID])
        d = int(os.environ.get(ENV_DEVICES_PER_PROC, "1"))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{ENV_COORDINATOR} is set but {e} is missing or not an integer (need "
                          f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}, {ENV_DEVICES_PER_PROC})") from None
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = _heartbeat_timeout()
    if not (0 <= pid < n) or d < 1:
        raise ConfigError(f"{ENV_PROCESS_ID}={pid}, {ENV_NUM_PROCESSES}={n}, {ENV_DEVICES_PER_PROC}={d} are "
                          "invalid (need 0 <= id < num_processes and devices >= 1)")
    from cfp.ir._jax_internals import backends_are_initialized

    if backends_are_initialized():
        raise CfpError("maybe_initialize_distributed() was called after JAX devices were used; call it "
                       "first thing in the program")
    os.environ["XLA_FLAGS"] = xla_flags_with_device_count(os.environ.get("XLA_FLAGS", ""), d)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
    jax.distributed.initialize(coord, n, pid, initialization_timeout=init_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               shutdown_timeout_seconds=shutdown_timeout_s)
    if fast_fail:
        _install_fast_fail()
    if jax.local_device_count() != d:  # e.g. a GPU backend, where the CPU device-count flag does nothing
        raise CfpError(f"rank {pid} has {jax.local_device_count()} local devices, expected "
                       f"{ENV_DEVICES_PER_PROC}={d} (set JAX_PLATFORMS=cpu to simulate devices)")
    return pid, n


def check_layout_fills_processes(device_ids, num_processes: int | None = None,
                                 devices_per_proc: int | None = None) -> None:
    """Refuse a multi-process job in which some process holds none of the layout's devices (it would sit
    idle) or a layout device lies beyond the job's devices. Process p holds the global device ids
    p*devices_per_proc .. (p+1)*devices_per_proc-1. Without arguments, the job is read from the ``CFP_*``
    variables (a single-process run passes)."""
    if num_processes is None:
        if not os.environ.get(ENV_COORDINATOR):
            return
        try:
            num_processes = int(os.environ[ENV_NUM_PROCESSES])
            devices_per_proc = int(os.environ.get(ENV_DEVICES_PER_PROC, "1"))
        except (KeyError, ValueError):
            return   # maybe_initialize_distributed names the bad variable
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
