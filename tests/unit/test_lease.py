"""The run folder's lease: one live writer, dead owners taken over, live ones refused naming the owner."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import folder_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.checkpoint import Checkpointer
from ddptrain.checkpoint.formats.rank0_torch import RankZeroTorchWriter
from ddptrain.checkpoint.lease import STALE_S, LeaseHeld, RunLease, me, read_owner
from ddptrain.cli import main
from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
from ddptrain.lockfile import heartbeat_age
from ddptrain.run_folder import LEASE, group_lease

# The run is refused before any data or model is read: these need not exist.
TINY_TOY = ["model.target=toy:build_model", "data.target=toy:build_datasets", "train.max_steps=2"]


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


# ---- a lease file that names no owner that can be checked (issue 24, item 10) ------------------------


def _record(**changes: object) -> dict[str, object]:
    return {**asdict(me()), **changes}


# The three through the command, then the other shapes through the lease itself.
MALFORMED_CLI = [
    pytest.param(_record(pid="abc"), 'has pid: "abc", not a valid pid', id="pid-string"),
    pytest.param(_record(pid=2**70), "has pid: 1180591620717411303424, not a valid pid", id="pid-2**70"),
    pytest.param(_record(pid=[1, 2]), "has pid: a list, not a valid pid", id="pid-list"),
]
MALFORMED = [
    pytest.param(json.dumps(_record(pid=True)).encode(), "has pid: true, not a valid pid", id="pid-bool"),
    pytest.param(json.dumps(_record(pid=0)).encode(), "has pid: 0, not a valid pid", id="pid-0"),
    pytest.param(json.dumps(_record(pid=-1)).encode(), "has pid: -1, not a valid pid", id="pid-negative"),
    pytest.param(json.dumps(_record(heartbeat="soon")).encode(), 'has heartbeat: "soon"', id="heartbeat-string"),
    pytest.param(json.dumps(_record(heartbeat=float("nan"))).encode(), "has heartbeat: NaN", id="heartbeat-nan"),
    pytest.param(json.dumps(_record(heartbeat=1e300)).encode(), "has heartbeat: 1e+300", id="heartbeat-huge"),
    pytest.param(json.dumps(_record(host=None)).encode(), "has host: null, not a valid host", id="host-null"),
    pytest.param(
        json.dumps({k: v for k, v in _record().items() if k != "token"}).encode(), "has no 'token'", id="no-token"
    ),
    pytest.param(b"[" * 100_000, "is larger than 65536 bytes", id="too-large"),
    pytest.param(b"[" * 60_000, "is not valid JSON", id="too-deep"),
    pytest.param(b"\xff\xfe not utf-8", "is not valid JSON", id="not-utf8"),
    pytest.param(b"", "is not valid JSON", id="empty"),
    pytest.param(b"[]", "is not a JSON object", id="a-list"),
]


@pytest.mark.parametrize(("record", "message"), MALFORMED_CLI)
def test_a_malformed_lease_is_refused_in_one_line_and_left_as_it_is(
    record: dict[str, object], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ddptrain train` (in this process): exit 2, one line naming the file, what is wrong and how to clear it;
    the lease is neither honoured as a live owner's nor taken over, and no byte of the folder changes."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank-0.log").write_text("an earlier run's lines\n")
    (run_dir / LEASE).write_text(json.dumps(record))
    before = folder_bytes(run_dir)
    rc = main(["train", *TINY_TOY, f"run.dir={run_dir}"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, (rc, out, err)
    assert lines[0].startswith(f"ddptrain train: error: run folder {run_dir}: its lease file {run_dir / LEASE} ")
    assert message in lines[0] and f"remove {run_dir / LEASE} and start again" in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert folder_bytes(run_dir) == before


@pytest.mark.parametrize(("content", "message"), MALFORMED)
def test_a_lease_of_any_other_malformed_shape_is_refused_and_left_as_it_is(
    content: bytes, message: str, tmp_path: Path
) -> None:
    (tmp_path / LEASE).write_bytes(content)
    with pytest.raises(LeaseHeld, match="so it names no owner that can be checked") as refused:
        RunLease(tmp_path).acquire(attempts=1)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert (tmp_path / LEASE).read_bytes() == content


def test_a_lease_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / LEASE)  # opening it for reading would wait for a writer forever
    with pytest.raises(LeaseHeld, match=r"is not a regular file, so it names no owner"):
        RunLease(tmp_path).acquire(attempts=1)
    (tmp_path / LEASE).unlink()
    (tmp_path / LEASE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(LeaseHeld, match=r"is not a regular file"):
        RunLease(tmp_path).acquire(attempts=1)
    assert (tmp_path / LEASE).is_symlink() and not (tmp_path / "elsewhere").exists()


SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner))
FIELDS = st.sampled_from(sorted(asdict(me())))


@st.composite
def lease_contents(draw: st.DrawFn) -> bytes:
    """Raw bytes, any JSON, or a real owner record with fields removed or given values of any type."""
    kind = draw(st.sampled_from(["bytes", "json", "record"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    record: dict[str, object] = asdict(me())
    for field in draw(st.lists(FIELDS, max_size=3)):
        if draw(st.booleans()):
            record.pop(field, None)
        else:
            record[field] = draw(JSON)
    return json.dumps(record).encode()


@given(content=lease_contents())
@settings(max_examples=60, deadline=None)
def test_any_lease_file_is_refused_or_taken_over_never_a_traceback(
    tmp_path_factory: pytest.TempPathFactory, content: bytes
) -> None:
    """Whatever the lease file holds: LeaseHeld (exit 2, one line) leaving it as it was, or (a valid record of
    an owner that is provably gone) taken over; never another exception."""
    folder = tmp_path_factory.mktemp("lease")
    (folder / LEASE).write_bytes(content)
    try:
        lease = RunLease(folder).acquire(attempts=1)
    except LeaseHeld as e:
        assert "\n" not in str(e) and len(str(e)) < 1000, str(e)
        assert (folder / LEASE).read_bytes() == content  # refused: never rewritten nor removed
        return
    try:
        assert lease.took_over is not None  # only a well-formed record of a dead owner is ever taken over
        assert read_owner(folder / LEASE) == lease.owner
    finally:
        lease.release()


def test_a_heartbeat_ahead_of_this_clock_says_so(tmp_path: Path) -> None:
    now = time.time()
    assert heartbeat_age(now - 12.4, now) == "12s ago"
    assert heartbeat_age(now + 0.2, now) == "0s ago"  # rounding, not skew
    assert heartbeat_age(now + 30, now) == "30s in the future (clock skew?)"
    _plant(tmp_path, host="node-elsewhere", pid=4245, heartbeat=time.time() + 3600)
    with pytest.raises(LeaseHeld, match=r"pid 4245 on node-elsewhere, heartbeat 3600s in the future \(clock skew\?\)"):
        RunLease(tmp_path).acquire()


# ---- a holder learns that its lease was taken (issue 24, item 8) ----------------------------------------


def test_a_holder_sees_its_lease_taken_removed_but_not_an_unreadable_one(tmp_path: Path) -> None:
    lease = RunLease(tmp_path).acquire()
    seen: list[str] = []
    lease.when_lost(seen.append)
    try:
        original = (tmp_path / LEASE).read_bytes()
        (tmp_path / LEASE).write_text("garbage")  # nobody can prove it is theirs: still ours, not a loss
        assert lease.taken_by() is None and not seen
        (tmp_path / LEASE).write_bytes(original)
        assert lease.taken_by() is None
        _plant(tmp_path, pid=4246, token="the-new-owner")
        assert lease.taken_by() == lease.lost and f"pid 4246 on {socket.gethostname()}" in (lease.lost or "")
        assert seen == [lease.lost]  # once, however often it is read again
        assert lease.taken_by() == seen[0] and seen == [lease.lost]
        late: list[str] = []
        lease.when_lost(late.append)  # registered after the loss: called at once
        assert late == seen
    finally:
        lease.release()
    assert read_owner(tmp_path / LEASE) is not None  # release never removes the new owner's lease
    other = RunLease(tmp_path / "removed")
    (tmp_path / "removed").mkdir()
    other.acquire()
    (tmp_path / "removed" / LEASE).unlink()  # taken and released by another run between two reads
    assert "was removed" in (other.taken_by() or "")
    other.release()


def _checkpointer(run_dir: Path, tag: str, lost: Callable[[], str | None] | None = None) -> Checkpointer:
    c = Checkpointer(
        CkptConfig(), run_dir, DistContext(), {"note": "lease"}, writer=RankZeroTorchWriter(), tag=tag, lease_lost=lost
    )
    c.setup()
    return c


def _state() -> tuple[dict[str, Any], dict[str, Any]]:
    return {"model": {"w": torch.ones(4)}, "optimizer": {"state": {}}, "trainer": {"step": 1}}, {"rng": {}}


def test_temp_folders_carry_their_runs_tag_and_a_taker_removes_only_other_runs(tmp_path: Path) -> None:
    """A lease holder's set-up removes the temp folders of runs that no longer hold the lease (another tag, or
    none: older versions), never its own; its saves use its own tag, so two runs never share a temp folder."""
    ckpts = tmp_path / "checkpoints"
    mine, theirs, old = (
        ckpts / ".tmp-step-00000003.aaaa",
        ckpts / ".tmp-step-00000003.bbbb",
        ckpts / ".tmp-step-00000004",
    )
    for folder in (mine, theirs, old):
        folder.mkdir(parents=True)
        (folder / "model.pt").write_bytes(b"partial")
    c = _checkpointer(tmp_path, "aaaa")
    assert mine.is_dir() and not theirs.exists() and not old.exists()
    c.save(5, *_state())
    (result,) = c.finished()
    assert result.ok and result.path == ckpts / "step-00000005" and not (ckpts / ".tmp-step-00000005.aaaa").exists()


def test_a_run_whose_lease_was_taken_commits_nothing(tmp_path: Path) -> None:
    """Rank 0 reads the lease before the commit: a taken lease leaves no checkpoint, no temp folder of its own,
    and a result every rank turns into LeaseLost."""
    who: list[str | None] = [None]
    c = _checkpointer(tmp_path, "aaaa", lambda: who[0])
    c.save(2, *_state())
    who[0] = "pid 4247 on node-elsewhere, heartbeat 0s ago"
    c.save(4, *_state())
    ok, refused = c.finished()
    assert ok.ok and ok.lease_lost is None
    assert not refused.ok and refused.lease_lost == who[0] and "took the run folder's lease" in (refused.error or "")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002"]


# ---- one writer across the modes, and the dead writers' temp folders (issue 38, items 2 and 7) ---------------------


def _plant_lease(run_dir: Path, name: str, **changes: object) -> str:
    """A lease file `name` in run_dir naming this process (a live owner) unless changes say otherwise; its token."""
    owner = replace(me(), **changes)  # type: ignore[arg-type]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / name).write_text(json.dumps(asdict(owner)))
    return owner.token


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_a_plain_run_and_an_in_place_group_never_hold_one_folder_together(tmp_path: Path) -> None:
    """Each mode's lease is refused while the other mode's is live, and let go again; a dead one does not count."""
    group = RunLease(tmp_path, group_lease(0)).acquire()
    try:
        with pytest.raises(LeaseHeld, match=rf"in use by replica group 0 of another mode \(pid {os.getpid()} on "):
            RunLease(tmp_path).acquire()
        assert not (tmp_path / LEASE).exists()
        RunLease(tmp_path, group_lease(1)).acquire().release()  # the same job's other groups are welcome
    finally:
        group.release()
    plain = RunLease(tmp_path).acquire()
    try:
        with pytest.raises(LeaseHeld, match=rf"in use by a run of another mode \(pid {os.getpid()} on "):
            RunLease(tmp_path, group_lease(3)).acquire()
        assert not (tmp_path / group_lease(3)).exists()
    finally:
        plain.release()
    _plant_lease(tmp_path, group_lease(2), pid=_dead_pid(), start="1")  # a group SIGKILLed long ago
    RunLease(tmp_path).acquire().release()


def test_ddptrain_train_on_a_live_in_place_jobs_folder_exits_2_naming_the_group_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    _plant_lease(run_dir, group_lease(4))  # this process: a live owner
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank-0.log").write_text("the job's lines\n")
    before = folder_bytes(run_dir)
    rc = main(["train", *TINY_TOY, f"run.dir={run_dir}"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, (rc, out, err)
    assert lines[0].startswith(f"ddptrain train: error: run folder {run_dir} is in use by replica group 4 of another")
    assert f"pid {os.getpid()} on " in lines[0]
    assert folder_bytes(run_dir) == before


def test_only_the_temp_folders_of_writers_holding_no_live_lease_are_removed(tmp_path: Path) -> None:
    """A writer SIGKILLed mid-save leaves its temp folder: the next start removes it, and any of a writer that holds
    no lease, but never a live replica group's save in progress, nor anything while a lease file is unreadable."""
    live = _plant_lease(tmp_path, group_lease(1))
    dead = _plant_lease(tmp_path, group_lease(2), pid=_dead_pid(), start="1")
    ckpts = tmp_path / "checkpoints"
    kept, killed, gone, untagged = (ckpts / f".tmp-step-00000003.{t}" for t in (live, dead, "cccc", ""))
    for folder in (kept, killed, gone, untagged):
        folder.mkdir(parents=True)
        (folder / "model.pt").write_bytes(b"partial")
    (tmp_path / group_lease(3)).write_text("not json")
    _checkpointer(tmp_path, "aaaa")
    assert all(f.is_dir() for f in (kept, killed, gone, untagged))  # an unreadable lease proves nobody dead
    (tmp_path / group_lease(3)).unlink()
    _checkpointer(tmp_path, "aaaa")
    assert kept.is_dir() and not killed.exists() and not gone.exists() and not untagged.exists()
