"""Coordinated preemption: SIGTERM/SIGUSR1 -> every rank stops at one step, checkpoint, exit 75; rerun resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cached_run, final_model_state, read_metrics, start_ddptrain
from toys import STOPPABLE

from ddptrain.checkpoint import committed_checkpoints, verify_checkpoint
from ddptrain.errors import EXIT_PREEMPTED

pytestmark = pytest.mark.dist

TOY = STOPPABLE
SLOW = "model.kwargs.step_sleep=0.1"


def start(argv: list[str], log: Path) -> Any:
    return start_ddptrain(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and any(
            json.loads(x).get("step", 0) >= step for x in path.read_text().splitlines() if '"kind": "train"' in x
        ):
            return
        time.sleep(0.1)
    pytest.fail(f"step {step} not reached")


@pytest.mark.timeout(300)
def test_sigusr1_to_launcher_stops_all_ranks_with_75_and_rerun_resumes(tmp_path: Path, reference_cache: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [
        "launch",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "20",
        "--",
        "train",
        *TOY,
        SLOW,
        f"run.dir={run_dir}",
    ]
    proc = start(argv, tmp_path / "first.log")
    wait_for_step(run_dir, 15, proc)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(60) == EXIT_PREEMPTED, (tmp_path / "first.log").read_text()[-3000:]
    [preempted] = [r for r in read_metrics(run_dir, "event") if r["event"] == "preempted"]
    assert preempted["signal"] == "SIGUSR1" and preempted["step"] > 15
    assert verify_checkpoint(committed_checkpoints(run_dir / "checkpoints")[0]).step == preempted["step"]
    assert max(r["step"] for r in read_metrics(run_dir)) == preempted["step"]  # no rank went further

    again = start(argv, tmp_path / "second.log")
    assert again.wait(150) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert [r["step"] for r in read_metrics(run_dir, "event") if r["event"] == "resume"] == [preempted["step"]]
    # The uninterrupted run on 2 ranks, shared with test_interrupt.py.
    reference = cached_run(reference_cache, ["train", *TOY, "run.dir={out}"], nproc=2)
    for k, v in final_model_state(reference).items():
        assert torch.equal(final_model_state(run_dir)[k], v), k


@pytest.mark.timeout(120)
def test_sigterm_to_a_single_process_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(["train", *TOY, SLOW, f"run.dir={run_dir}"], tmp_path / "log")
    wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == EXIT_PREEMPTED
    [preempted] = [r for r in read_metrics(run_dir, "event") if r["event"] == "preempted"]
    assert verify_checkpoint(committed_checkpoints(run_dir / "checkpoints")[0]).step == preempted["step"]
