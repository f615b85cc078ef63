"""`ddptrain report` tells a restarted run as one story: exact accounting on a metrics file with known times.

The file is in the trainer's record format (what tests/dist/test_report_restarts.py produces
with real processes), with round times so that every number of the summary can be checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddptrain.cli import main
from ddptrain.observe.report import read_records
from ddptrain.observe.story import goodput, tell


def _train(step: int, t: float, ws: int, **extra: object) -> dict[str, object]:
    return {
        "kind": "train",
        "time": t,
        "step": step,
        "loss": 5.0 - 0.1 * step,
        "lr": 1e-3,
        "step_time_s": 1.0,
        "samples_per_s": 32.0,
        "tokens_per_s": 1000.0 * ws,
        "world_size": ws,
        "global_batch_size": 32,
        **extra,
    }


RECORDS = [
    {"kind": "event", "time": 0.0, "event": "start", "step": 0, "world_size": 2},
    _train(2, 2.0, 2),
    _train(4, 4.0, 2),
    {"kind": "event", "time": 4.5, "event": "checkpoint", "step": 4, "blocked_s": 0.5, "total_s": 0.6},
    _train(6, 6.5, 2),  # after the checkpoint the next attempt resumes from: re-done, dropped
    # the process died here (no stop record)
    {"kind": "event", "time": 10.0, "event": "resume", "step": 4, "world_size": 1},
    {
        "kind": "event",
        "time": 11.0,
        "event": "recovery",
        "step": 5,
        "restart_count": 1,
        "since": "failure_seen",
        "total_s": 4.0,
        "phases": [["stop", 0.5], ["rendezvous", 1.5], ["import", 1.0], ["first step", 1.0]],
    },
    _train(6, 12.0, 1, skipped_steps=1),
    {"kind": "event", "time": 12.5, "event": "checkpoint_failed", "step": 6, "error": "disk full"},
    _train(8, 14.5, 1),
    {"kind": "event", "time": 15.0, "event": "preempted", "step": 8, "signal": "SIGTERM", "world_size": 1},
    {"kind": "event", "time": 20.0, "event": "resume", "step": 8, "world_size": 1},
    _train(10, 22.0, 1),
]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp_path / "config.yaml").write_text("run:\n  name: story\ntrain:\n  max_steps: 10\n")
    return tmp_path


def test_abandoned_records_are_cut_and_time_is_accounted(run_dir: Path) -> None:
    records, _ = read_records(run_dir / "metrics.jsonl")
    story = tell(records, finished=True)
    assert [r["step"] for r in story.kept if r["kind"] == "train"] == [2, 4, 6, 8, 10]  # one record per step
    assert story.redone_steps == 2 and story.redone_s == 2.0
    assert [(e.kind, e.step, e.time) for e in story.events] == [
        ("crashed", 6, 6.5),
        ("resume", 4, 10.0),
        ("world size", 4, 10.0),
        ("recovery", 5, 11.0),
        ("skipped steps", 6, 12.0),
        ("save failed", 6, 12.5),
        ("preempted", 8, 15.0),
        ("resume", 8, 20.0),
        ("completed", 10, 22.0),  # an older version's run: no completed record, but it reached max_steps
    ]
    assert [(e.kind, e.recorded) for e in story.endings] == [
        ("crashed", False),
        ("preempted", True),
        ("completed", False),
    ]
    g = goodput(story)
    assert (g.wall_s, g.productive_s) == (22.0, 10.0)
    assert g.lost == {
        "re-done steps": 2.0,
        "restarts (down time)": 8.5,
        "checkpoint blocking": 0.5,
        "other (eval, logging, start-up)": 1.0,
    }


def test_summary_lists_segments_goodput_and_events(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "run: story" in out and "status: finished (10 steps)" in out
    assert "steps: 10 (world size 2 -> 1, global batch 32; 3 attempt(s))" in out
    assert "  world size 2, steps 2-4: 2,000 mean over 1 log windows" in out
    assert "  world size 1, steps 6-10: 1,000 mean over 2 log windows" in out
    assert (
        "goodput: 45.5% (10.0 s of productive steps in 22.0 s wall time); lost: re-done steps 2.0 s; "
        "restarts (down time) 8.5 s; checkpoint blocking 0.5 s; other (eval, logging, start-up) 1.0 s "
        "(2 steps re-done)"
    ) in out
    assert "events: 9" in out
    assert "attempts: crashed, preempted, completed" in out
    assert (
        "  attempt 1 from step 0 at world size 2: crashed: ended without an end record (last record at step 6): "
        "killed (SIGKILL, out of memory), power lost or node lost?"
    ) in out
    assert (
        "step      5  recovery: 4.00 s from failure_seen to the first step: stop 0.50, rendezvous 1.50, "
        "import 1.00, first step 1.00"
    ) in out
    assert (
        "00:00:15 UTC (+15 s)  step      8  preempted: attempt 2 preempted by SIGTERM at step 8, checkpoint committed "
        "(exit 75)"
    ) in out
    assert "step      4  world size: world size 2 -> 1" in out
    assert "step      6  crashed: attempt 1 ended without an end record (last record at step 6)" in out
    for name in ("loss", "lr", "throughput", "step_time", "goodput"):
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 10_000
