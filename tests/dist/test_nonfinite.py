"""A NaN loss on one rank: every rank skips that step together (or all stop), never diverging."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import read_metrics, run_ddptrain
from toys import FAULTY

pytestmark = pytest.mark.dist

NAN_ON_RANK1_AT_STEP5 = [
    *FAULTY,
    "log.every_steps=1",
    "ckpt.every_steps=0",
    "train.max_steps=8",
    "model.kwargs.nan_at=5",
    "model.kwargs.nan_rank=1",
]


def checksums(record_dir: Path, rank: int) -> list[str]:
    [path] = record_dir.glob(f"params-rank{rank}-*.txt")
    return [line.split()[1] for line in path.read_text().splitlines()]


@pytest.mark.timeout(180)
def test_nan_on_one_rank_is_skipped_on_all(tmp_path: Path) -> None:
    rec = tmp_path / "params"
    done = run_ddptrain(
        ["train", *NAN_ON_RANK1_AT_STEP5, f"model.kwargs.record_dir={rec}", f"run.dir={tmp_path / 'run'}"],
        nproc=2,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = checksums(rec, 0), checksums(rec, 1)
    assert len(rank0) == 8 and rank0 == rank1  # identical parameters on both ranks before every step
    assert rank0[5] == rank0[4]  # step 5 changed nothing (skipped)...
    assert len(set(rank0)) == 7  # ...and every other step did
    skipped = {r["step"]: r.get("skipped_steps", 0) for r in read_metrics(tmp_path / "run")}
    assert skipped == {s: int(s == 5) for s in range(1, 9)}


@pytest.mark.timeout(180)
def test_nan_on_one_rank_stops_all_when_configured(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_ddptrain(
        ["train", *NAN_ON_RANK1_AT_STEP5, "train.on_nonfinite=stop", f"run.dir={run_dir}"], nproc=2, timeout=150
    )
    assert done.returncode != 0
    [stopped] = [r for r in read_metrics(run_dir, "event") if r["event"] == "stopped"]
    assert stopped["step"] == 4 and "non-finite gradient norm" in stopped["reason"]
    # A decided stop on every rank (exit 1 with one message), not a crash of one rank.
    assert "error: non-finite gradient norm" in done.stderr and "RankFailure" not in done.stderr
