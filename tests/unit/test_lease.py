"""The run folder's lease: one live writer, dead owners taken over, live ones refused naming the owner."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from ddptrain.checkpoint.lease import LEASE, STALE_S, LeaseHeld, RunLease, me, read_owner


def test_a_second_acquire_is_refused_naming_the_owner(tmp_path: Path) -> None:
    first = RunLease(tmp_path).acquire()
    try:
        with pytest.raises(LeaseHeld, match=rf"in use by another run \(pid {first.owner.pid} on "):
            RunLease(tmp_path).acquire()
    finally:
        first.release()
    assert not (tmp_path / LEASE).exists()
    RunLease(tmp_path).acquire().release()  # free again


def _plant(tmp_path: Path, **changes: object) -> None:
    (tmp_path / LEASE).write_text(json.dumps(asdict(replace(me(), **changes))))  # type: ignore[arg-type]


def test_a_dead_owners_lease_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _plant(tmp_path, pid=dead.pid, start="1")
    lease = RunLease(tmp_path).acquire()
    assert lease.took_over is not None and lease.took_over.pid == dead.pid
    owner = read_owner(tmp_path / LEASE)
    assert owner is not None and owner.token == lease.owner.token
    lease.release()


def test_a_reused_pid_does_not_keep_a_lease_alive(tmp_path: Path) -> None:
    _plant(tmp_path, pid=1, start="not-the-start-time-of-pid-1")  # pid 1 lives, but is not the owner
    lease = RunLease(tmp_path).acquire()
    assert lease.took_over is not None
    lease.release()


def test_other_hosts_are_judged_by_their_heartbeat(tmp_path: Path) -> None:
    _plant(tmp_path, host="node-elsewhere", pid=4242, heartbeat=time.time() - 5)
    with pytest.raises(LeaseHeld, match="pid 4242 on node-elsewhere"):
        RunLease(tmp_path).acquire()
    _plant(tmp_path, host="node-elsewhere", pid=4242, heartbeat=time.time() - STALE_S - 1)
    lease = RunLease(tmp_path).acquire()
    assert lease.took_over is not None and lease.took_over.host == "node-elsewhere"
    lease.release()


def test_release_never_removes_another_owners_lease(tmp_path: Path) -> None:
    lease = RunLease(tmp_path).acquire()
    _plant(tmp_path, pid=4243, token="someone-else")
    lease.release()
    owner = read_owner(tmp_path / LEASE)
    assert owner is not None and owner.token == "someone-else"


def _contend(folder: str, ready: mp.Barrier, done: mp.Barrier, results: mp.Queue) -> None:  # type: ignore[type-arg]
    ready.wait()
    try:
        lease = RunLease(Path(folder)).acquire()
        results.put("won")
        done.wait()
        lease.release()
    except LeaseHeld as e:
        results.put(f"refused: {e}")
        done.wait()


@pytest.mark.timeout(60)
def test_simultaneous_starts_exactly_one_wins(tmp_path: Path) -> None:
    n = 4
    ctx = mp.get_context("fork")
    ready, done, results = ctx.Barrier(n), ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), ready, done, results)) for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=30) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
    assert outcomes.count("won") == 1, outcomes
    assert all("in use by another run" in o for o in outcomes if o != "won")


def test_an_earlier_round_of_the_same_elastic_job_on_another_node_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _plant(tmp_path, host="node-elsewhere", pid=4244, job="torchrun job-1", heartbeat=time.time())
    lease = RunLease(tmp_path).acquire()  # torchrun stopped that round's workers before starting this one
    assert lease.took_over is not None and lease.took_over.host == "node-elsewhere"
    lease.release()
    _plant(tmp_path, host="node-elsewhere", pid=4244, job="torchrun job-2", heartbeat=time.time())
    with pytest.raises(LeaseHeld, match="job torchrun job-2"):
        RunLease(tmp_path).acquire()  # another job: alive while its heartbeat is fresh
