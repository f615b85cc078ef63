"""The slow-links benchmark's figures (bench/slow_links.py): samples over time between logged steps past warm-up,
DiLoCo's bytes and time blocked per step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's bench package

from bench.slow_links import job_figures, samples_per_s  # noqa: E402


def test_the_rate_leaves_out_start_up_and_the_warm_up_steps() -> None:
    # Steps 1-4 are slow (buckets built, PowerSGD not yet on); from step 5 on, one step of 32 every 0.5 s.
    times = {1: 10.0, 2: 14.0, 3: 15.0, 4: 18.0, 5: 18.5, 6: 19.0, 7: 19.5, 8: 20.0}
    records = [{"kind": "train", "step": s, "time": t, "global_batch_size": 32} for s, t in times.items()]
    records.insert(3, {"kind": "eval", "step": 3, "time": 15.1})
    assert samples_per_s(records, warm=4) == pytest.approx(64.0)
    with pytest.raises(AssertionError, match="fewer than two logged steps after step 7"):
        samples_per_s(records, warm=7)


def test_bytes_and_time_blocked_are_per_step_over_the_whole_run() -> None:
    # 4 steps logged every 2: 0.5 s a step; 100 + 300 bytes launched, 0.1 s blocked in all.
    records: list[dict[str, object]] = [{"kind": "event", "time": 0.0}]
    for step, sent, blocked, t in ((2, 100, 0.0, 11.0), (4, 300, 0.1, 12.0)):
        row = {"kind": "train", "step": step, "time": t, "global_batch_size": 32, "step_time_s": 0.5}
        records.append({**row, "outer_syncs": step // 2, "outer_sync_bytes": 300, "outer_sent_bytes": sent})
        records[-1]["outer_sync_s"] = blocked
    records.append({"kind": "eval", "step": 4, "time": 12.1, "val_loss": 2.5})
    got = job_figures(records, warm=0)
    assert got["bytes_per_step"] == 100.0 and got["outer_syncs"] == 2 and got["outer_sync_bytes"] == 300
    assert got["blocked_s_per_step"] == pytest.approx(0.025) and got["blocked_share"] == pytest.approx(0.05)
    assert got["samples_per_s"] == pytest.approx(64.0) and got["val_loss"] == 2.5
