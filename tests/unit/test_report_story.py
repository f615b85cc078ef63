"""`ddptrain report` tells a restarted run as one story: exact accounting on a metrics file with known times.

The file is in the trainer's record format (what tests/dist/test_report_restarts.py produces
with real processes), with round times so that every number of the summary can be checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_run_records
from hypothesis import given
from hypothesis import strategies as st

from ddptrain.cli import main
from ddptrain.review.report import EVENT_STYLE, event_marks, read_records
from ddptrain.review.story import goodput, tell


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
    return write_run_records(tmp_path, RECORDS, "story", 10)


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


def _attempt(start_step: int, t: float, *end: dict[str, object]) -> list[dict[str, object]]:
    """One attempt of a run with max_steps 10: a start, a train record two steps on, then its end records."""
    start = "start" if start_step == 0 else "resume"
    return [
        {"kind": "event", "time": t, "event": start, "step": start_step, "world_size": 1},
        _train(start_step + 2, t + 1.0, 1),
        *end,
    ]


def _end(kind: str, step: int, t: float, **fields: object) -> dict[str, object]:
    return {"kind": "event", "time": t, "event": kind, "step": step, **fields}


ENDED_EVERY_WAY = [
    *_attempt(0, 0.0, _end("interrupted", 2, 2.0, signal="SIGINT", exit_code=130, world_size=1)),
    *_attempt(2, 10.0, _end("preempted", 4, 12.0, signal="SIGTERM", exit_code=75, world_size=1)),
    *_attempt(4, 20.0),  # killed: no end record
    *_attempt(6, 30.0, _end("stopped", 8, 32.0, exit_code=1, reason="non-finite gradient norm (nan) at step 8")),
    *_attempt(8, 40.0, _end("completed", 10, 42.0, exit_code=0)),
]


def test_each_ending_is_classified_from_its_record_and_a_kill_from_its_absence() -> None:
    story = tell(ENDED_EVERY_WAY, finished=True)
    assert [(e.kind, e.step, e.exit_code, e.recorded) for e in story.endings] == [
        ("interrupted", 2, 130, True),
        ("preempted", 4, 75, True),
        ("crashed", 6, None, False),
        ("stopped", 8, 1, True),
        ("completed", 10, 0, True),
    ]
    details = [e.detail for e in story.endings]
    assert details[0] == "interrupted by SIGINT at step 2, checkpoint committed (exit 130)"
    assert details[2].startswith("ended without an end record (last record at step 6): killed")
    assert details[3] == "stopped at step 8: non-finite gradient norm (nan) at step 8 (exit 1)"


def test_a_second_ctrl_c_and_an_error_are_told_apart_from_a_kill() -> None:
    quit_at_once = _end("interrupted", 3, 3.0, signal="SIGINT", exit_code=130, checkpoint=False)
    error = _end("crashed", 5, 13.0, exit_code=1, error="rank 0 on h failed in step 5: RuntimeError: boom")
    story = tell([*_attempt(0, 0.0, quit_at_once), *_attempt(2, 10.0, error)], finished=False)
    assert [e.detail for e in story.endings] == [
        "interrupted by SIGINT at step 3, quit at once, no checkpoint (exit 130)",
        "crashed at step 5: rank 0 on h failed in step 5: RuntimeError: boom (exit 1)",
    ]


def test_records_of_older_versions_are_read_with_their_kind_s_exit_code() -> None:
    # Before end records, an interruption had no exit code and a finished attempt no record at all.
    story = tell([*_attempt(0, 0.0, _end("interrupted", 2, 2.0, signal="SIGINT")), *_attempt(2, 10.0)], finished=True)
    assert [(e.kind, e.exit_code, e.recorded) for e in story.endings] == [
        ("interrupted", 130, True),
        ("completed", 0, False),
    ]
    last = tell(_attempt(0, 0.0), finished=False).endings[-1]  # no later attempt: maybe still running
    assert last.kind == "crashed" and last.detail.endswith("; or still running")


def test_summary_says_interrupted_and_each_kind_has_its_own_mark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = ENDED_EVERY_WAY[:-3]  # without the completing attempt: the run ends stopped
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "config.yaml").write_text("run:\n  name: endings\ntrain:\n  max_steps: 10\n")
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "status: stopped at step 8: non-finite gradient norm (nan) at step 8 (exit 1)" in out
    assert "attempts: interrupted, preempted, crashed, stopped" in out
    assert "  attempt 1 from step 0 at world size 1: interrupted by SIGINT at step 2, checkpoint committed" in out
    assert "ended without a stop record" not in out
    records, _ = read_records(tmp_path / "metrics.jsonl")
    marks = {m.kind: m for m in event_marks(tell(records, finished=False))}
    endings = ["interrupted", "preempted", "crashed", "stopped"]
    assert set(endings) <= set(marks)
    assert len({(marks[k].colour, marks[k].marker) for k in endings}) == len(endings)  # all different
    assert len({EVENT_STYLE[k][:1] + EVENT_STYLE[k][2:] for k in EVENT_STYLE}) == len(EVENT_STYLE)
    assert (tmp_path / "report" / "loss.png").stat().st_size > 10_000


def _start(step: int, t: float) -> dict[str, object]:
    return {"kind": "event", "time": t, "event": "start" if step == 0 else "resume", "step": step, "world_size": 1}


@given(every=st.integers(1, 20), resumed=st.integers(0, 200), ahead=st.integers(1, 60), recorded=st.booleans())
def test_the_steps_re_done_are_those_past_the_resume_step_up_to_the_crash(
    every: int, resumed: int, ahead: int, recorded: bool
) -> None:
    """A crash at step `resumed + ahead` (with its end record, or killed: its last record tells the step), resumed
    from the checkpoint at `resumed`: every step after `resumed` that the crashed attempt trained is re-done, logged
    or not."""
    crash = resumed + ahead
    first = [_train(s, float(s), 1) for s in range(every, crash + 1, every)]
    end = [_end("crashed", crash, crash + 0.5, exit_code=1, error="boom")] if recorded else []
    records = [_start(0, 0.0), *first, *end, _start(resumed, 1000.0), _train(crash + every, 1001.0, 1)]
    story = tell(records, finished=False)
    steps = list(range(every, crash + 1, every))
    reached = crash if recorded else max(steps, default=0)
    assert story.redone_steps == max(reached - resumed, 0)
    # Their time at _train's 1 s a step; the logged steps up to the resume step are productive (a log window across
    # it counts on both sides), and so is the resumed attempt's window.
    assert story.redone_s == pytest.approx(story.redone_steps if steps else 0.0)
    assert story.productive_s == pytest.approx(min(resumed, max(steps, default=0)) + ahead + every)


def test_the_issue_s_crash_at_88_resumed_from_75_re_did_13_steps() -> None:
    # It logged every 10 steps: its last record after 75 was step 80, which once made it "5 steps re-done".
    first = [_train(s, float(s), 1) for s in range(10, 81, 10)]
    records = [_start(0, 0.0), *first, _end("crashed", 88, 88.5, exit_code=1), _start(75, 100.0)]
    assert tell(records, finished=False).redone_steps == 13
