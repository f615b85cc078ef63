"""Data default batching could not take, under torchrun (gloo, 2 ranks): bare-tensor items, variable-length tokens.

Before data.collate, a dataset of bare tensors was unpacked along the batch dimension into forward
(`TypeError: forward() takes 2 positional arguments but 9 were given`, exit 1), and samples of different
lengths could not be stacked at all.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from helpers import read_metrics, run_ddptrain

from ddptrain.cli import main

pytestmark = pytest.mark.dist
STEPS = ["train.warmup_steps=0", "log.every_steps=1", "data.micro_batch_size=2", "train.global_batch_size=8"]
BARE = ["model.target=varlen_toy:bare_model", "data.target=varlen_toy:bare_datasets", *STEPS]
# The built-in GPT on token sequences of 3 to 33 ids, padded per micro-batch to its longest (block_size + 1).
VARLEN = [
    "data.target=varlen_toy:varlen_datasets",
    "data.collate=pad",
    *("model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=32", "model.vocab_size=64"),
    *("train.eval_batches=1", "ckpt.every_steps=2", *STEPS),
]
EVAL_LINE = re.compile(r"on varlen_toy:varlen_datasets val: (\d+) samples, loss (\d+\.\d+)")


@pytest.mark.timeout(200)
def test_bare_tensor_items_reach_forward_as_one_batch(tmp_path: Path) -> None:
    run = tmp_path / "bare"
    done = run_ddptrain(
        ["train", *BARE, "train.max_steps=2", "train.eval_every=2", "train.eval_batches=1", f"run.dir={run}"],
        nproc=2,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in read_metrics(run))
    assert math.isfinite(read_metrics(run, "eval")[0]["val_loss"])


@pytest.mark.timeout(240)
def test_variable_length_samples_train_padded_resume_and_evaluate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "varlen"
    first = run_ddptrain(["train", *VARLEN, "train.max_steps=2", f"run.dir={run}"], nproc=2, timeout=150)
    assert first.returncode == 0, first.stderr[-3000:]
    # Resumed at one rank (the certificate's sample ids carry the position), to step 4.
    resumed = run_ddptrain(["train", *VARLEN, "train.max_steps=4", f"run.dir={run}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in read_metrics(run))
    assert "resume" in {r.get("event") for r in read_metrics(run, "event")}
    logged = read_metrics(run, "eval")[-1]  # each run evaluates at its end, through the collate too
    assert logged["step"] == 4

    # ddptrain eval batches the samples with the run's data.collate and repeats the trainer's val_loss.
    assert main(["eval", str(run), "--batches", "1"]) == 0
    found = EVAL_LINE.search(capsys.readouterr().out)
    assert found and int(found[1]) == 8 and float(found[2]) == pytest.approx(logged["val_loss"], abs=2e-6)
