"""Ctrl-C is a coordinated stop: every rank stops at one step, a checkpoint is committed, exit 130,
and running the same command again resumes bit-exactly. A second Ctrl-C quits at once."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cached_run, env_for_subprocess, final_model_state, read_metrics, start_ddptrain
from toys import STOPPABLE

import ddptrain
from ddptrain.checkpoint import committed_checkpoints, verify_checkpoint
from ddptrain.errors import EXIT_INTERRUPTED

pytestmark = pytest.mark.dist

TOY = STOPPABLE
SLOW = "model.kwargs.step_sleep=0.1"


def start(argv: list[str], log: Path) -> Any:
    """The command with SIGINT handled as in a terminal (start_ddptrain's processes have it so)."""
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


def wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if text in log.read_text():
            return
        time.sleep(0.05)
    pytest.fail(f"{text!r} not printed: {log.read_text()[-2000:]}")


def assert_interrupted_with_checkpoint(run_dir: Path, log: Path, agent_traceback: bool = False) -> int:
    """The interrupted event's step, checked against the committed checkpoint and the metrics."""
    [event] = [r for r in read_metrics(run_dir, "event") if r["event"] == "interrupted"]
    assert event["signal"] == "SIGINT"
    newest = committed_checkpoints(run_dir / "checkpoints")[0]
    assert verify_checkpoint(newest).step == event["step"]
    assert max(r["step"] for r in read_metrics(run_dir)) == event["step"]  # no rank went further
    text = log.read_text()
    assert f"interrupted at step {event['step']} (SIGINT): checkpoint committed" in text
    if agent_traceback:  # plain torchrun's agent re-raises the signal with a traceback of its own
        assert text.count("Traceback") <= 1 and f'File "{Path(ddptrain.__file__).parent}' not in text
    else:
        assert "Traceback" not in text
    return int(event["step"])


def assert_quiet_stop(text: str) -> None:
    """An intended stop under `ddptrain launch` says itself in ddptrain's lines only: none of torchelastic's
    W/E log lines, no multiprocessing resource-tracker warning (issue 38, item 14)."""
    assert not re.search(r"^[WE]\d{4} \d\d:\d\d:\d\d", text, re.MULTILINE), text[-3000:]
    assert "leaked semaphore" not in text and "resource_tracker" not in text, text[-3000:]


def assert_same_weights(a: Path, b: Path) -> None:
    ref, got = final_model_state(a), final_model_state(b)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@pytest.mark.timeout(240)
def test_ctrl_c_single_process_checkpoints_exits_130_and_resumes_bit_exactly(
    tmp_path: Path, reference_cache: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", *TOY, SLOW, f"run.dir={run_dir}"]
    proc = start(argv, tmp_path / "first.log")
    wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == EXIT_INTERRUPTED, (tmp_path / "first.log").read_text()[-3000:]
    step = assert_interrupted_with_checkpoint(run_dir, tmp_path / "first.log")
    assert 5 <= step < 40

    again = start(argv, tmp_path / "second.log")
    assert again.wait(120) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert [r["step"] for r in read_metrics(run_dir, "event") if r["event"] == "resume"] == [step]
    assert_same_weights(cached_run(reference_cache, ["train", *TOY, "run.dir={out}"]), run_dir)


@pytest.mark.timeout(360)
def test_ctrl_c_to_launch_with_2_ranks_checkpoints_exits_130_and_resumes_bit_exactly(
    tmp_path: Path, reference_cache: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = [
        "launch",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "30",
        "--",
        "train",
        *TOY,
        SLOW,
        f"run.dir={run_dir}",
    ]
    proc = start(argv, tmp_path / "first.log")
    wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C does: the launcher forwards it to the ranks
    assert proc.wait(90) == EXIT_INTERRUPTED, (tmp_path / "first.log").read_text()[-3000:]
    step = assert_interrupted_with_checkpoint(run_dir, tmp_path / "first.log")
    assert "the workers committed a checkpoint" in (tmp_path / "first.log").read_text()
    assert_quiet_stop((tmp_path / "first.log").read_text())

    again = start(argv, tmp_path / "second.log")
    assert again.wait(180) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert [r["step"] for r in read_metrics(run_dir, "event") if r["event"] == "resume"] == [step]
    # The uninterrupted run on 2 ranks, shared with test_preemption.py: the same weights either way.
    reference = cached_run(reference_cache, ["train", *TOY, "run.dir={out}"], nproc=2)
    assert_same_weights(reference, run_dir)


@pytest.mark.timeout(240)
def test_ctrl_c_to_plain_torchrun_stops_both_ranks_with_a_checkpoint(tmp_path: Path) -> None:
    """torchrun's agent passes SIGINT on to its workers: they stop together and commit."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ddptrain",
        "train",
        *TOY,
        SLOW,
        f"run.dir={run_dir}",
    ]
    log = tmp_path / "torchrun.log"
    proc = subprocess.Popen(
        cmd,
        env=env_for_subprocess(),
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGINT)
    proc.wait(90)  # torchrun itself re-raises the signal: its own exit code is torch's business
    assert_interrupted_with_checkpoint(run_dir, log, agent_traceback=True)


@pytest.mark.timeout(180)
def test_a_second_ctrl_c_quits_at_once(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "log"
    # 2 micro-batches x 3 s: the step in progress when the second Ctrl-C comes still has seconds to go.
    proc = start(["train", *TOY, "model.kwargs.step_sleep=3", "log.every_steps=1", f"run.dir={run_dir}"], log)
    wait_for_step(run_dir, 1, proc)
    proc.send_signal(signal.SIGINT)
    wait_for_line(log, "Ctrl-C again to quit at once", proc)  # the first one is being handled
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == EXIT_INTERRUPTED
    # Quit, not stopped: the step in progress never finished (no record of it) and nothing was saved.
    assert [r["step"] for r in read_metrics(run_dir)] == [1], "the second Ctrl-C waited for the step"
    assert not committed_checkpoints(run_dir / "checkpoints")
    text = log.read_text()
    assert "ddptrain train: error: interrupted by SIGINT, then quit at once on Ctrl-C at step" in text
    assert "Traceback" not in text


@pytest.mark.parametrize("launch", [False, True], ids=["train", "launch-2-workers"])
@pytest.mark.parametrize(("first", "second", "code"), [("SIGINT", "SIGTERM", 130), ("SIGTERM", "SIGINT", 75)])
@pytest.mark.timeout(240)
def test_the_first_stop_signal_decides_the_exit_code(
    tmp_path: Path, first: str, second: str, code: int, launch: bool
) -> None:
    """Issue 24, item 9: a second stop signal 0.2 s after the first (while the stop runs, or the run closes, or
    the interpreter exits) never rewrites the exit code: exit code == every "(exit N)" printed == the first's."""
    run_dir = tmp_path / "run"
    launcher = ["launch", "--nproc-per-node", "2", "--shutdown-timeout", "30", "--"] if launch else []
    log = tmp_path / "log"
    proc = start(
        [*launcher, "train", *TOY, "train.max_steps=1000", "model.kwargs.step_sleep=0.05", f"run.dir={run_dir}"], log
    )
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(getattr(signal, first))
    time.sleep(0.2)  # the 0.05-0.5 s
    proc.send_signal(getattr(signal, second))
    assert proc.wait(90) == code, log.read_text()[-3000:]
    text = log.read_text()
    assert set(re.findall(r"\(exit (\d+)\)", text)) == {str(code)}, text[-3000:]
    assert "Traceback" not in text
    if launch:
        assert f"ddptrain launch: stopped by {first};" in text
        assert_quiet_stop(text)
    [*_, ending] = [r for r in read_metrics(run_dir, "event") if r["event"] in ("interrupted", "preempted")]
    assert (ending["exit_code"], ending["signal"]) == (code, first)
