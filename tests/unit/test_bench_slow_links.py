"""The slow-links benchmark's rate (bench/slow_links.py): samples over time between logged steps past warm-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's bench package

from bench.slow_links import samples_per_s  # noqa: E402


def test_the_rate_leaves_out_start_up_and_the_warm_up_steps() -> None:
    # Steps 1-4 are slow (buckets built, PowerSGD not yet on); from step 5 on, one step of 32 every 0.5 s.
    times = {1: 10.0, 2: 14.0, 3: 15.0, 4: 18.0, 5: 18.5, 6: 19.0, 7: 19.5, 8: 20.0}
    records = [{"kind": "train", "step": s, "time": t, "global_batch_size": 32} for s, t in times.items()]
    records.insert(3, {"kind": "eval", "step": 3, "time": 15.1})
    assert samples_per_s(records, warm=4) == pytest.approx(64.0)
    with pytest.raises(AssertionError, match="fewer than two logged steps after step 7"):
        samples_per_s(records, warm=7)
