"""Workers stop when their agent dies (SIGKILL of the agent alone: the OOM killer's pick, `kill -9`).

torchrun's workers and `ddptrain launch`'s (forked from a fork server) run in sessions of their
own, so nothing reaches them; before, they trained on unsupervised and kept the run folder's
lease. Now each stops as for SIGTERM: a committed checkpoint, the lease released, every process
of the job gone; the restarted job is accepted and resumes. When the stop cannot complete (a
frozen peer), a worker exits after the grace period all the same.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import descendants, env_for_subprocess, read_metrics, run_ddptrain
from test_broken_output import COMMANDS, newest_step
from test_interrupt import SLOW, TOY, wait_for_step

from ddptrain.checkpoint import committed_checkpoints, verify_checkpoint
from ddptrain.run_folder import LEASE

pytestmark = pytest.mark.dist

GONE_WITHIN_S = 90  # a bound, not a measurement: the stop itself takes a step and a tiny save
STARTS = {
    "launch-preloaded": [*COMMANDS["launch"][:-1], "--worker-start", "preloaded", "--"],
    "launch-exec": [*COMMANDS["launch"][:-1], "--worker-start", "exec", "--"],
    "torchrun": COMMANDS["torchrun"],
}


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    alive = [p for p in pids if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if running(p)]
    return alive


def workers_of(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the job's workers, as each one's log names it (a preloaded worker's /proc environ
    is its fork server's)."""
    found = {}
    for log in (run_dir / "logs").glob("rank-*.log"):
        match = re.search(r"rank (\d+) of \d+ on .*, pid (\d+)", log.read_text())
        if match:
            found[int(match[1])] = int(match[2])
    return found


def start_job(
    start: list[str], argv: list[str], log: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], list[int], dict[int, int]]:
    run_dir = Path(argv[-1].split("=", 1)[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*start, *argv], env=env_for_subprocess(env), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    wait_for_step(run_dir, 4, proc)
    workers = workers_of(run_dir)
    assert sorted(workers) == [0, 1], workers
    pids = descendants(proc.pid)
    assert set(workers.values()) <= set(pids), (workers, pids)
    return proc, pids, workers


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def assert_accepted_and_resumed(run_dir: Path, argv: list[str], step: int) -> None:
    """A new run on the folder takes the lease (released, not taken over) and resumes at `step`."""
    assert not (run_dir / LEASE).exists()
    again = run_ddptrain([*argv, f"train.max_steps={step + 1}"], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "took over the lease" not in again.stdout + again.stderr
    assert [r["step"] for r in read_metrics(run_dir, "event") if r["event"] == "resume"] == [step]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", sorted(STARTS))
def test_workers_stop_with_a_checkpoint_when_their_agent_is_killed(how: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", *TOY, SLOW, "train.max_steps=400", f"run.dir={run_dir}"]
    proc, pids, workers = start_job(STARTS[how], argv, tmp_path / "agent.log")
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the agent only: its workers are in sessions of their own
        proc.wait(10)
        left = wait_until_gone(pids, GONE_WITHIN_S)
        assert not left, f"still running {GONE_WITHIN_S} s after the agent died: {left}"
    finally:
        kill_all(pids)
    [event] = [r for r in read_metrics(run_dir, "event") if r["event"] == "preempted"]
    step = int(event["step"])
    assert step < 400 and newest_step(run_dir) == step  # stopped early, every rank at the same step
    assert verify_checkpoint(committed_checkpoints(run_dir / "checkpoints")[0]).step == step
    logs = [(run_dir / "logs" / f"rank-{rank}.log").read_text() for rank in sorted(workers)]
    assert all(f"stopped at step {step} on request" in text for text in logs), logs[0][-2000:]
    # The first rank to notice asks for the stop; the other may be stopped by the agreement before it notices.
    assert any(f"the agent that started this worker (pid {proc.pid}) is gone" in text for text in logs)
    assert_accepted_and_resumed(run_dir, argv, step)


@pytest.mark.timeout(300)
def test_a_worker_whose_stop_cannot_complete_exits_after_the_grace(tmp_path: Path) -> None:
    """Rank 1 frozen (SIGSTOP), then the agent killed: rank 0 cannot agree on the stop and exits after the
    grace anyway, releasing the lease; rank 1, thawed, finds its agent gone and its peer too, and ends."""
    run_dir = tmp_path / "run"
    argv = ["train", *TOY, SLOW, "train.max_steps=400", f"run.dir={run_dir}"]
    grace = {"DDPTRAIN_STOP_GRACE_S": "3"}
    proc, pids, workers = start_job(STARTS["torchrun"], argv, tmp_path / "agent.log", grace)
    try:
        wait_for_step(run_dir, 11, proc)  # past the checkpoint of step 10, the one to resume from
        os.kill(workers[1], signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert not wait_until_gone([workers[0]], GONE_WITHIN_S), "rank 0 outlived its grace"
        assert not (run_dir / LEASE).exists()  # released by rank 0 on its way out
        os.kill(workers[1], signal.SIGCONT)
        assert not wait_until_gone(pids, GONE_WITHIN_S)
    finally:
        kill_all(pids)
    text = (run_dir / "logs" / "rank-0.log").read_text()
    assert "the stop did not complete within 3 s of the agent's death: exiting now" in text, text[-2000:]
    assert not [r for r in read_metrics(run_dir, "event") if r["event"] == "preempted"]
    assert_accepted_and_resumed(run_dir, argv, 10)


@pytest.mark.timeout(300)
def test_workers_done_when_their_agent_is_killed_leave_instead_of_waiting_for_it(tmp_path: Path) -> None:
    """A forked worker whose run ended waits for the agent to read its result (torch's worker wrapper), its run's
    watch closed by then: the agent frozen until both ranks are done, then killed, must not leave them waiting."""
    run_dir = tmp_path / "run"
    argv = ["train", *TOY, "train.max_steps=12", f"run.dir={run_dir}"]
    proc, pids, workers = start_job(STARTS["launch-preloaded"], argv, tmp_path / "agent.log")
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # it cannot collect what its workers return
        logs = [run_dir / "logs" / f"rank-{rank}.log" for rank in sorted(workers)]
        deadline = time.monotonic() + GONE_WITHIN_S
        while time.monotonic() < deadline and not (
            all("done: 12 steps" in log.read_text() for log in logs) and not (run_dir / LEASE).exists()
        ):
            time.sleep(0.2)
        assert not (run_dir / LEASE).exists(), [log.read_text()[-1000:] for log in logs]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        left = wait_until_gone(pids, GONE_WITHIN_S)
        assert not left, f"still running {GONE_WITHIN_S} s after the agent died: {left}"
    finally:
        kill_all([proc.pid, *pids])
    assert newest_step(run_dir) == 12
    assert not [r for r in read_metrics(run_dir, "event") if r["event"] == "preempted"]
