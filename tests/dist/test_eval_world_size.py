"""The validation loss of one checkpoint is one number: at 1, 2 and 3 ranks, from the trainer and `ddptrain eval`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import read_metrics, run_ddptrain

from ddptrain.cli import main

pytestmark = pytest.mark.dist
LOSS = re.compile(r": (\d+) samples, loss (\d+\.\d+), perplexity")


def eval_line(text: str) -> tuple[int, float]:
    found = LOSS.search(text)
    assert found, text
    return int(found[1]), float(found[2])


@pytest.mark.timeout(240)
def test_one_checkpoint_one_val_loss_at_1_2_and_3_ranks(
    tiny_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    # 2 global batches of 8 = 16 samples: 8 a rank at 2 ranks (the trainer), 6/5/5 at 3 ranks.
    trained = run_ddptrain(["train", *tiny_args, "train.eval_every=6", "train.eval_batches=2"], nproc=2, timeout=180)
    assert trained.returncode == 0, trained.stderr[-3000:]
    (logged,) = read_metrics(run_dir, "eval")
    assert logged["step"] == 6

    assert main(["eval", str(run_dir), "--step", "6", "--batches", "2"]) == 0  # one process, in this one
    samples, alone = eval_line(capsys.readouterr().out)
    assert samples == 16 and alone == pytest.approx(logged["val_loss"], abs=2e-6)

    # 3 ranks, micro-batches of 5: shares of 6, 5, 5 samples, so rank 0 runs 2 batches and the others 1 and a
    # filler that does not count.
    three = run_ddptrain(
        ["eval", str(run_dir), "data.micro_batch_size=5", "--step", "6", "--batches", "2"], nproc=3, timeout=120
    )
    assert three.returncode == 0, three.stderr[-3000:]
    assert eval_line(three.stdout) == (16, pytest.approx(logged["val_loss"], abs=2e-6))
