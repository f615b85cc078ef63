"""A run with a story, made with real processes: it crashes, resumes at another world size, is
preempted, and finishes at the first world size again.

1. `torchrun --nproc-per-node 2 ... train`; once training passes `crash_after`, rank 1 is killed
   with SIGKILL (the job fails: no restarts allowed);
2. `ddptrain train` alone (world size 1) resumes from the newest checkpoint; once it passes
   `preempt_after` it gets SIGTERM, commits a checkpoint and exits 75;
3. `torchrun --nproc-per-node 2 ... train` resumes and trains to the end.

Used by tests/dist/test_report_restarts.py, and to make the figures of docs/observability.md:

    python tests/restart_story.py RUN_DIR CRASH_AFTER PREEMPT_AFTER [OVERRIDES...]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import env_for_subprocess  # noqa: E402


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return -1
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if record.get("kind") == "train":
            steps.append(record["step"])
    return steps[-1] if steps else -1


def _wait_past(proc: subprocess.Popen[bytes], run_dir: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _last_step(run_dir) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"training ended (exit {proc.poll()}) or stalled before step {step}")
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _start(args: list[str], nproc: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ddptrain", "train", *args]
    if nproc:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "ddptrain",
            "train",
            *args,
        ]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env_for_subprocess(), stdout=out, stderr=subprocess.STDOUT)


def make_story(
    run_dir: Path, crash_after: int, preempt_after: int, overrides: list[str], timeout: float = 300
) -> list[int]:
    """Run the three attempts; returns their exit codes (expected: non-zero, 75, 0)."""
    args = [*overrides, f"run.dir={run_dir}"]
    log = run_dir.parent / f"{run_dir.name}-attempts.log"
    codes = []
    first = _start(args, 2, log)
    try:
        _wait_past(first, run_dir, crash_after, timeout)
        workers = sorted(_children(first.pid))
        os.kill(workers[-1], signal.SIGKILL)  # one rank dies: the job fails
        codes.append(first.wait(timeout=120))
    finally:
        first.kill()
    second = _start(args, 0, log)
    try:
        _wait_past(second, run_dir, preempt_after, timeout)
        second.send_signal(signal.SIGTERM)  # preemption: commit and exit 75
        codes.append(second.wait(timeout=120))
    finally:
        second.kill()
    third = _start(args, 2, log)
    codes.append(third.wait(timeout=timeout))
    return codes


if __name__ == "__main__":
    run, crash, preempt, *rest = sys.argv[1:]
    print(make_story(Path(run).resolve(), int(crash), int(preempt), rest))
