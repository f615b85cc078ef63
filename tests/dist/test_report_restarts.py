"""`ddptrain report` on a real run that crashed, resumed at another world size, was preempted and finished."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY, read_metrics
from restart_story import make_story

from ddptrain.cli import main

pytestmark = pytest.mark.dist


@pytest.mark.timeout(400)
def test_report_tells_the_story_of_a_restarted_run(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    config = [*TINY, f"data.dir={corpus_dir}", "train.max_steps=60", "ckpt.every_steps=10", "train.eval_every=20"]
    codes = make_story(run_dir, crash_after=14, preempt_after=32, overrides=config)
    assert codes[0] != 0 and codes[1:] == [75, 0], codes
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "status: finished (60 steps)" in out and "world size 2 -> 1 -> 2" in out and "3 attempt(s)" in out
    events = [line.split("  ")[-1] for line in out.splitlines() if line.startswith("  ") and " UTC (+" in line]
    kinds = [e.split(":")[0] for e in events]
    assert kinds.count("resume") == 2 and kinds.count("world size") == 2, out
    assert "crashed" in kinds and "preempted" in kinds, out
    assert kinds.index("crashed") < kinds.index("preempted")
    assert "world size 2 -> 1" in out and "world size 1 -> 2" in out
    segments = [line for line in out.splitlines() if line.startswith("  world size ")]
    assert [s.split(",")[0] for s in segments] == ["  world size 2", "  world size 1", "  world size 2"], out
    assert "goodput: " in out and "restarts (down time)" in out
    # Steps logged twice were re-done after a restart. Usually the crash lands between checkpoints (some
    # are); on a loaded machine it can land right after a commit (none are): the line follows the log.
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert ("steps re-done)" in out) == (len(steps) > len(set(steps))), out
    for name in ("loss", "lr", "throughput", "step_time", "goodput"):
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 10_000
