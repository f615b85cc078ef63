"""A training process that dies of an uncaught error leaves the traceback in its rank log (a real process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_ddptrain

pytestmark = pytest.mark.dist


def test_uncaught_error_lands_in_the_rank_log(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_ddptrain(
        [
            "train",
            "model.target=observe_toy:build_failing_model",
            "data.target=toy:build_datasets",
            "data.micro_batch_size=4",
            "train.global_batch_size=4",
            "train.max_steps=10",
            "train.eval_every=0",
            f"run.dir={run_dir}",
        ]
    )
    assert proc.returncode != 0
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "RuntimeError: deliberate failure on rank 0 in forward call 3" in log and "Traceback" in log
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["event"] == "start"
