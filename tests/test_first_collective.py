"""The processes of a set of devices meet (a coordination-service barrier) before the first collective on it
(`cfp.runtime.cliques`): XLA's gloo builds a clique's connections then, with a fixed 30 s deadline for every peer
to arrive, which compile skew on a loaded host exceeds (issue 41: "Gloo context initialization failed:
DEADLINE_EXCEEDED", the peer aborting). Fast: the meeting's bookkeeping against a recording client. Slow: two
real processes, one reaching each first collective 35 s late, complete both."""
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import cfp.ir._jax_internals as internals
from cfp.errors import CfpError
from cfp.runtime import cliques

LATE_S = 35      # past gloo's 30 s


class _Client:
    def __init__(self, error=None):
        self.barriers, self.error = [], error

    def wait_at_barrier(self, barrier_id, timeout_in_ms, process_ids=None):
        self.barriers.append((barrier_id, timeout_in_ms, list(process_ids)))
        if self.error:
            raise self.error


def _devices(*pairs):
    return [SimpleNamespace(id=i, process_index=p) for i, p in pairs]


@pytest.fixture
def client(monkeypatch):
    c = _Client()
    monkeypatch.setattr(internals, "distributed_client", lambda: c)
    monkeypatch.setattr(cliques, "_met", set())
    return c


def test_processes_meet_once_before_a_cliques_first_collective(client):
    pair = _devices((2048, 1), (2, 0))
    assert cliques.meet_before_first_collective(pair)
    assert client.barriers == [("cfp-first-collective:2048,2", cliques.MEET_TIMEOUT_S * 1000, [0, 1])]
    assert not cliques.meet_before_first_collective(_devices((2048, 1), (2, 0)))   # the same clique: met already
    # the other direction is another clique (gloo keys contexts by the ordered list: "gloo/2,2048" vs
    # "gloo/2048,2", seen failing under load in that order)
    assert cliques.meet_before_first_collective(list(reversed(pair)))
    assert client.barriers[-1] == ("cfp-first-collective:2,2048", cliques.MEET_TIMEOUT_S * 1000, [0, 1])
    assert cliques.meet_before_first_collective(_devices((0, 0), (4096, 2)))  # another clique, its own processes
    assert client.barriers[-1] == ("cfp-first-collective:0,4096", cliques.MEET_TIMEOUT_S * 1000, [0, 2])
    assert len(client.barriers) == 3


def test_devices_of_one_process_need_no_meeting(client):
    assert not cliques.meet_before_first_collective(_devices((0, 0), (1, 0)))
    assert client.barriers == []


def test_the_meeting_waits_for_the_arrays_the_collective_reads(client, monkeypatch):
    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x))
    ready = [np.zeros(2)]
    cliques.meet_before_first_collective(_devices((0, 0), (2048, 1)), ready=ready)
    assert waited == [ready] and len(client.barriers) == 1


def test_a_peer_that_never_arrives_is_one_line_naming_the_processes_and_devices(monkeypatch):
    c = _Client(error=jax.errors.JaxRuntimeError("DEADLINE_EXCEEDED: Barrier timed out.\nmore"))
    monkeypatch.setattr(internals, "distributed_client", lambda: c)
    monkeypatch.setattr(cliques, "_met", set())
    with pytest.raises(CfpError) as e:
        cliques.meet_before_first_collective(_devices((3, 0), (2051, 1)))
    msg = str(e.value)
    assert "\n" not in msg and "processes [0, 1]" in msg and "devices [3, 2051]" in msg
    assert f"within {cliques.MEET_TIMEOUT_S} s" in msg and "DEADLINE_EXCEEDED" in msg


@pytest.mark.slow
def test_a_process_reaching_each_first_collective_late_still_completes_it():
    rank = os.path.join(os.path.dirname(__file__), "late_rank.py")
    cmd = [sys.executable, "-m", "cfp.cli.main", "launch", "--nprocs", "2", "--devices-per-proc", "4",
           "--timeout", "300", "--", sys.executable, rank, str(LATE_S)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    for p in (0, 1):
        assert f"[rank {p}] process {p} gathered [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]" in out.stdout, text[-3000:]
    assert "[rank 1] process 1 moved [100.0, 101.0, 102.0]" in out.stdout, text[-3000:]
    assert "[rank 0] process 0 moved None" in out.stdout, text[-3000:]
