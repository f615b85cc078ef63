"""A run whose lease another run took stops at once, writes nothing more and exits 73 (issue 24, item 8).

Two real runs on one run folder: A (`ddptrain launch`, 2 workers) trains; A's rank 0 is stopped (SIGSTOP) so that
its heartbeat cannot repair the lease while it is made stale by hand (it now names a pid that is gone); B (a
plain `ddptrain train`) starts, takes the lease over and trains; A's rank 0 is let go (SIGCONT). Both of A's ranks
stop at the same step and the launcher does not restart them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import start_ddptrain
from toys import FAULTY

from ddptrain.errors import EXIT_LEASE_LOST
from ddptrain.run_folder import LEASE

pytestmark = pytest.mark.dist

TOY = [*FAULTY, "model.kwargs.step_sleep=0.02"]


def start(args: list[str], out: Path, launch: list[str] = []) -> Any:  # noqa: B006 - never mutated
    return start_ddptrain(
        [*launch, "train", *TOY, *args],
        stdout=open(out.with_suffix(".out"), "w"),
        stderr=open(out.with_suffix(".err"), "w"),
    )


def wait_until(condition: object, what: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline and proc.poll() is None, f"{what}: not seen"
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_a_run_that_lost_its_lease_stops_at_once_and_writes_nothing_more(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpts, lease = run_dir / "checkpoints", run_dir / LEASE
    a = start(
        [f"run.dir={run_dir}", "train.max_steps=100000", "log.every_steps=1", "ckpt.every_steps=5"],
        tmp_path / "a",
        ["launch", "--nproc-per-node", "2", "--max-restarts", "3", "--"],
    )
    b: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: (ckpts / "step-00000005").is_dir(), "A's checkpoint of step 5", a)
        record = json.loads(lease.read_text())
        rank0 = record["pid"]  # the lease holder: A's rank 0, whose heartbeat thread watches the lease
        os.kill(rank0, signal.SIGSTOP)
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        lease.write_text(json.dumps({**record, "pid": gone.pid}))  # stale by hand: its owner looks dead
        newest = max(int(p.name[5:]) for p in ckpts.glob("step-*"))
        last = newest + 10
        # B logs only its last step and saves only at its end: any other record or folder after its start is A's.
        # Its steps are slower than A's: A, let go, sees B's lease long before B ends.
        b = start(
            [
                f"run.dir={run_dir}",
                f"train.max_steps={last}",
                "log.every_steps=1000",
                "ckpt.every_steps=0",
                "model.kwargs.step_sleep=0.1",
            ],
            tmp_path / "b",
        )
        wait_until(lambda: json.loads(lease.read_text())["token"] != record["token"], "B's lease", b)
        wait_until(lambda: '"event": "resume"' in (run_dir / "metrics.jsonl").read_text(), "B's resume", b)
        os.kill(rank0, signal.SIGCONT)
        assert a.wait(120) == EXIT_LEASE_LOST, (tmp_path / "a.err").read_text()[-3000:]
        assert b.wait(120) == 0, (tmp_path / "b.err").read_text()[-3000:]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
    text = (tmp_path / "a.out").read_text() + (tmp_path / "a.err").read_text()
    lines = sorted(line for line in text.splitlines() if "took the lease on run folder" in line)
    said = f"another run took the lease on run folder {run_dir}; it now belongs to pid {b.pid} on "
    # One line per rank, both naming B (rank 1 knows it from the refused save), both at the same step.
    assert [line.split(": error: ")[0] for line in lines] == ["[rank 1] ddptrain train", "ddptrain train"], text[-3000:]
    assert all(line.split(": error: ")[1].startswith(said) for line in lines), lines
    assert f"(exit {EXIT_LEASE_LOST})" in lines[0] and "Traceback" not in text
    stopped_at = int(lines[0].split("stopped at step ")[1].split()[0])
    assert all(f"stopped at step {stopped_at} " in line for line in lines)
    assert f"another run took the run folder's lease (a worker exited {EXIT_LEASE_LOST}; not restarted)" in text
    assert f"took over the lease of a run that is gone (pid {gone.pid} on " in (tmp_path / "b.err").read_text()

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = max(i for i, r in enumerate(records) if r.get("event") == "resume")
    after = [(r["kind"], r.get("event"), r["step"]) for r in records[resumed + 1 :]]
    assert [x for x in after if x[2] == last] == [
        ("train", None, last),
        ("event", "checkpoint", last),
        ("event", "completed", last),
    ]  # B's
    # A's, from being let go until it saw B's lease: step records (train, ranks) up to the step it stopped at,
    # nothing after; no event but the record of a checkpoint it had committed before it was stopped (stopped
    # between its folder's rename and the record), no checkpoint after (its save was refused), no end record.
    assert all(
        step <= stopped_at < last if kind != "event" else (event, step) == ("checkpoint", newest)
        for kind, event, step in after
        if step != last
    ), after
    assert sorted(p.name for p in ckpts.glob("step-*") if int(p.name[5:]) > newest) == [f"step-{last:08d}"]
    assert not (ckpts / "archive").exists() and not list(ckpts.glob(".tmp-*"))
    assert not lease.exists()  # B released it; A never wrote it again
    assert "another run took the lease" not in (run_dir / "logs" / "rank-0.log").read_text()  # nor its log
