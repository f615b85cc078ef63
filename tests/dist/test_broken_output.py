"""Output that nobody reads any more never costs the work.

`ddptrain train ... 2>&1 | tee log`, then Ctrl-C: the terminal's SIGINT ends tee as well, and
every later write to the pipe fails. Here the reader (a real tee) is killed first, training must
go on past the broken pipe, then SIGINT goes to the process group as a terminal sends it: the
coordinated stop commits its checkpoint, the command exits 130, and the same command resumes.
Also with fd 1 closed outright (`>&-`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env_for_subprocess, read_metrics, run_ddptrain
from test_interrupt import SLOW, TOY, wait_for_step

from ddptrain.checkpoint import committed_checkpoints, verify_checkpoint
from ddptrain.errors import EXIT_INTERRUPTED

pytestmark = pytest.mark.dist

PYTHON_M = [sys.executable, "-m"]
COMMANDS = {
    "single": [*PYTHON_M, "ddptrain"],
    "launch": [*PYTHON_M, "ddptrain", "launch", "--nproc-per-node", "2", "--shutdown-timeout", "30", "--"],
    "torchrun": [*PYTHON_M, "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ddptrain"],
}


def _as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell would have SIGINT ignored


def newest_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir)), default=0)


def assert_stopped_with_checkpoint(run_dir: Path, ranks: int) -> int:
    """The interrupted event's step: committed, no rank went further, every rank said so in its own log."""
    [event] = [r for r in read_metrics(run_dir, "event") if r["event"] == "interrupted"]
    assert event["signal"] == "SIGINT"
    step = int(event["step"])
    assert verify_checkpoint(committed_checkpoints(run_dir / "checkpoints")[0]).step == step
    assert newest_step(run_dir) == step
    for rank in range(ranks):
        text = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"interrupted at step {step}" in text and "checkpoint committed" in text, text[-2000:]
        assert "Traceback" not in text and "BrokenPipeError" not in text, text[-3000:]
    return step


def assert_resumes(run_dir: Path, argv: list[str], step: int) -> None:
    """The same run, one step further, in one process: accepted (the lease is free) and resumed at `step`."""
    again = run_ddptrain([*argv, f"train.max_steps={step + 1}"], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir, "event") if r["event"] == "resume"] == [step]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["single", "launch", "torchrun"])
def test_ctrl_c_after_the_log_reader_died_commits_and_exits_130(how: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", *TOY, SLOW, f"run.dir={run_dir}"]
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [*COMMANDS[how], *argv],
        env=env_for_subprocess(),
        stdin=subprocess.DEVNULL,
        stdout=write_end,
        stderr=write_end,
        start_new_session=True,
        preexec_fn=_as_in_a_terminal,
    )
    os.close(write_end)
    tee = subprocess.Popen(["tee", str(tmp_path / "tee.log")], stdin=read_end, stdout=subprocess.DEVNULL)
    os.close(read_end)  # tee holds the only reading end: when it dies, the pipe is broken
    try:
        wait_for_step(run_dir, 4, proc)
        tee.kill()
        tee.wait(10)
        broken_at = newest_step(run_dir)
        wait_for_step(run_dir, broken_at + 2, proc)  # training goes on while its output fails
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground process group
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if how != "torchrun":  # plain torchrun's own exit code after a signal is torch's (docs/exit-codes.md)
        assert code == EXIT_INTERRUPTED
    assert "step" in (tmp_path / "tee.log").read_text()  # the reader did see the first steps
    step = assert_stopped_with_checkpoint(run_dir, 1 if how == "single" else 2)
    assert step > broken_at
    assert_resumes(run_dir, argv, step)


@pytest.mark.timeout(240)
def test_ctrl_c_with_stdout_closed_commits_and_exits_130(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", *TOY, SLOW, f"run.dir={run_dir}"]

    def closed_stdout() -> None:
        _as_in_a_terminal()
        os.close(1)  # `>&-`: no descriptor 1 at all, not /dev/null

    with open(tmp_path / "stderr.log", "wb") as err:
        proc = subprocess.Popen(
            [*COMMANDS["single"], *argv],
            env=env_for_subprocess(),
            stdin=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=closed_stdout,
        )
    try:
        wait_for_step(run_dir, 4, proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == EXIT_INTERRUPTED
    finally:
        if proc.poll() is None:
            proc.kill()
    step = assert_stopped_with_checkpoint(run_dir, 1)
    stderr = (tmp_path / "stderr.log").read_text()
    assert "Ctrl-C again to quit at once" in stderr and "Traceback" not in stderr, stderr[-3000:]
    # Nothing meant for stdout landed in a file that took descriptor 1.
    assert all(line.startswith("{") for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert_resumes(run_dir, argv, step)
