"""Metrics of your own, early stopping and hooks under torchrun (gloo, 2 ranks).

The model (tests/metrics_toy.py) returns {"loss", "abs_err", "plateau", "pred"}: abs_err and plateau are
metrics, pred (per sample) is an output; train.metrics adds target_mean. plateau rises with the steps
trained until step 6 and then stays: under train.early_stop {metric: val_plateau, mode: max, patience: 2}
and an evaluation every 2 steps, the best is step 6 and the run ends at step 10.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import TESTS_DIR, read_metrics, run_ddptrain

from ddptrain.cli import main

pytestmark = pytest.mark.dist
RUN = [
    "model.target=metrics_toy:plateau_model",
    "data.target=varlen_toy:bare_datasets",
    "train.metrics=metrics_toy:target_mean",
    "data.micro_batch_size=2",
    "train.global_batch_size=4",  # accumulation 1 at 2 ranks: plateau after step s is min(s, 6)
    "train.warmup_steps=0",
    "train.eval_every=2",
    "train.eval_batches=1",
    "log.every_steps=2",
    "ckpt.every_steps=100",
    "ckpt.keep=1",
    "train.early_stop={metric: val_plateau, mode: max, patience: 2}",
]
METRICS = ["abs_err", "plateau", "target_mean"]


@pytest.mark.timeout(240)
def test_metrics_logged_evaluated_and_early_stop_resumed_mid_patience(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    # To step 8: evaluations at 2, 4, 6 (the best) and 8 (one without improvement); it completes mid-patience.
    first = run_ddptrain(["train", *RUN, "train.max_steps=8", f"run.dir={run}"], nproc=2, timeout=150)
    assert first.returncode == 0, first.stderr[-3000:]
    train, evals = read_metrics(run), read_metrics(run, "eval")
    assert [r["custom_metrics"] for r in train] == [METRICS] * 4
    assert [r["plateau"] for r in train] == [1.5, 3.5, 5.5, 6.0]  # window means over ranks: (1+2)/2, (3+4)/2, ...
    assert "pred" not in train[0] and all(f"val_{m}" in e for e in evals for m in METRICS)
    assert [e["val_plateau"] for e in evals] == [2.0, 4.0, 6.0, 6.0]

    # Resumed with room to go on: the count continues (1 of 2), so the evaluation at step 10 ends it.
    second = run_ddptrain(["train", *RUN, "train.max_steps=40", f"run.dir={run}"], nproc=2, timeout=150)
    assert second.returncode == 0, second.stderr[-3000:]
    why = "early stop: val_plateau did not improve by more than 0 (max) in 2 evaluations; best 6 at step 6"
    assert f"finished early at step 10: {why}" in second.stdout
    for rank in range(2):  # both ranks stopped after step 10, for the same reason
        assert f"finished early at step 10: {why}" in (run / "logs" / f"rank-{rank}.log").read_text()
    end = read_metrics(run, "event")[-1]
    assert (end["event"], end["step"], end["exit_code"], end["reason"]) == ("finished_early", 10, 0, why)
    # ckpt.keep=1 pruned steps 2, 4 and 8, never the marked best.
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000006", "step-00000010"]
    assert json.loads((run / "checkpoints" / "best.json").read_text())["step"] == 6

    # ddptrain eval of the best checkpoint on the trainer's evaluation samples: the numbers it logged.
    assert main(["eval", str(run), "--step", "6", "--batches", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    printed = dict(re.findall(r"(\w+) (-?\d+\.\d+)", line.split("samples, ", 1)[1]))
    at_6 = evals[2]
    assert float(printed["loss"]) == pytest.approx(at_6["val_loss"], abs=1e-6)
    for m in METRICS:
        assert float(printed[m]) == pytest.approx(at_6[f"val_{m}"], abs=1e-6), line

    # Run again (alone: any world size resumes): it had finished early, so it ends at once, training nothing.
    third = run_ddptrain(["train", *RUN, "train.max_steps=40", f"run.dir={run}"], timeout=150)
    assert third.returncode == 0 and f"finished early at step 10: {why}" in third.stdout, third.stderr[-3000:]
    assert read_metrics(run)[-1]["step"] == 10


@pytest.mark.timeout(200)
def test_a_hook_on_one_rank_stops_every_rank_with_a_checkpoint(tmp_path: Path) -> None:
    done = run_ddptrain(
        [str(TESTS_DIR / "hook_worker.py"), str(tmp_path / "run"), str(tmp_path), "3"], nproc=2, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"hook-rank{r}.json").read_text()) for r in range(2)]
    stop = seen[0]["step"]
    assert 3 < stop < 30  # rank 1 asked at step 3; the agreement reads it a step or two later, on every rank
    for s in seen:
        assert (s["status"], s["step"], s["checkpoint"], s["read_only"]) == ("finished_early", stop, [stop], True)
        assert s["log"] == list(range(1, stop + 1)) and s["eval"] == list(range(2, stop + 1, 2))
        assert set(METRICS[:2]) <= set(s["log_keys"])
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")] == [f"step-{stop:08d}"]
    end = read_metrics(tmp_path / "run", "event")[-1]
    assert end["event"] == "finished_early" and end["reason"].startswith("a hook on another rank asked")
