"""Every way an attempt ends, with real processes and real signals, told by `ddptrain report`.

One run folder, four attempts: Ctrl-C (SIGINT, exit 130), SIGTERM (exit 75), SIGKILL (no end record),
then a resume to the end. The report must call them interrupted, preempted, crashed and completed,
each with its own mark on the plots.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import read_metrics, start_ddptrain
from test_interrupt import SLOW, TOY, wait_for_step

from ddptrain.cli import main
from ddptrain.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED
from ddptrain.review.report import event_marks, read_records
from ddptrain.review.story import tell

pytestmark = pytest.mark.dist

STEPS = int(next(a for a in reversed(TOY) if a.startswith("train.max_steps=")).split("=")[1])  # the toy's length


def start(run_dir: Path, log: Path) -> Any:
    """`ddptrain train` with SIGINT handled as in a terminal (start_ddptrain's processes have it so)."""
    return start_ddptrain(["train", *TOY, SLOW, f"run.dir={run_dir}"], stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def last_step(run_dir: Path) -> int:
    return max(r["step"] for r in read_metrics(run_dir))


@pytest.mark.timeout(300)
def test_report_tells_interrupted_preempted_crashed_and_completed_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "attempts.log"
    for sig, code in ((signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_PREEMPTED), (signal.SIGKILL, -9)):
        proc = start(run_dir, log)
        try:
            wait_for_step(run_dir, (last_step(run_dir) if run_dir.exists() else 0) + 2, proc)
            proc.send_signal(sig)
            assert proc.wait(60) == code, log.read_text()[-3000:]
        finally:
            proc.kill()
            proc.wait()
    proc = start(run_dir, log)
    assert proc.wait(120) == 0, log.read_text()[-3000:]

    ends = [(r["event"], r["exit_code"]) for r in read_metrics(run_dir, "event") if "exit_code" in r]
    assert ends == [("interrupted", 130), ("preempted", 75), ("completed", 0)]  # the kill left none
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"status: finished ({STEPS} steps)" in out
    assert "attempts: interrupted, preempted, crashed, completed" in out, out
    lines = [line for line in out.splitlines() if line.startswith("  attempt ")]
    assert "interrupted by SIGINT at step" in lines[0] and "checkpoint committed (exit 130)" in lines[0], out
    assert "preempted by SIGTERM at step" in lines[1] and "(exit 75)" in lines[1], out
    assert "crashed: ended without an end record" in lines[2], out
    assert f"completed at step {STEPS} (exit 0)" in lines[3], out

    records, _ = read_records(run_dir / "metrics.jsonl")
    marks = [
        m
        for m in event_marks(tell(records, finished=True))
        if m.kind in ("interrupted", "preempted", "crashed", "completed")
    ]
    assert sorted(m.kind for m in marks) == ["completed", "crashed", "interrupted", "preempted"]
    assert len({(m.colour, m.marker) for m in marks}) == 4  # a mark of its own for each
    for name in ("loss", "lr", "throughput", "step_time", "goodput"):
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 10_000
