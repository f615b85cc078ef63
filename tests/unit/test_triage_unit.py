"""`ddptrain triage` on folders without forensics (exit 2, one line) and the reduction of frames to a place."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddptrain.cli import main
from ddptrain.review.verdict import where


@pytest.mark.parametrize("make", ["nothing", "empty stacks", "only text stacks"])
def test_triage_without_reports_is_exit_2_with_one_line(
    tmp_path: Path, make: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if make != "nothing":
        (tmp_path / "stacks").mkdir()
    if make == "only text stacks":
        (tmp_path / "stacks" / "rank-0-vm.txt").write_text("Traceback ...")
    assert main(["triage", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain triage: error: no ")


def test_where_names_the_dataloader_and_the_innermost_frame() -> None:
    frames = [
        {"file": "/x/ddptrain/train/trainer.py", "line": 10, "function": "Trainer.next_batch"},
        {
            "file": "/v/site-packages/torch/utils/data/dataloader.py",
            "line": 733,
            "function": "_BaseDataLoaderIter.__next__",
        },
        {
            "file": "/v/site-packages/torch/utils/data/_utils/fetch.py",
            "line": 52,
            "function": "_MapDatasetFetcher.fetch",
        },
        {"file": "/home/me/proj/mydata.py", "line": 88, "function": "Shards.__getitem__"},
    ]
    assert where(frames, "pipe_read") == (
        "in the DataLoader's __next__, at proj/mydata.py:88 in Shards.__getitem__ (in the kernel: pipe_read)"
    )


def test_report_events_mark_each_episode_once_and_hangs() -> None:
    from ddptrain.review.diagnostic_events import diagnostic_events, summarize_diagnostic_events

    records = [
        {"kind": "ranks", "step": 10, "local_step_s": [0.01, 0.01]},
        {"kind": "ranks", "step": 20, "straggler_rank": 1, "straggler_host": "node2", "ratio": 1.31},
        {"kind": "ranks", "step": 30, "straggler_rank": 1, "straggler_host": "node2", "ratio": 1.4},  # same episode
        {"kind": "ranks", "step": 40, "slow_comm_ratio": 3.0},
        {"kind": "event", "event": "hang", "step": 45, "rank": 0, "phase": "step", "waited_s": 2.2},
    ]
    events = diagnostic_events(records)
    assert [(e.step, e.kind) for e in events] == [(20, "straggler"), (40, "slow communication"), (45, "hang")]
    assert summarize_diagnostic_events(events) == [
        "hang episodes: 1 (step 45: rank 0 saw no progress for 2.2 s (step))",
        "straggler episodes: 1 (step 20: rank 1 on node2 (1.31x))",
        "slow communication episodes: 1 (step 40: 3.0x baseline)",
    ]
