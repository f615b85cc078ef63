"""The training step under each precision, and the non-finite gradient policy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import make_trainer

from ddptrain.errors import NonFiniteError


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_precisions_train_and_save_their_scaler(corpus_dir: Path, tmp_path: Path, precision: str) -> None:
    trainer = make_trainer(corpus_dir, tmp_path, [f"train.precision={precision}"])
    losses = [float(trainer.train_step().loss) for _ in range(4)]
    assert all(math.isfinite(x) for x in losses)
    scaler_state = trainer.state_dict()["trainer"]["scaler"]
    assert bool(scaler_state) == (precision == "fp16")  # only fp16 needs loss scaling


def poison(trainer) -> None:  # type: ignore[no-untyped-def]
    """Make the next forward produce NaN, as a diverging model would."""
    with torch.no_grad():
        trainer.model.wte.weight[:, 0] = float("nan")


def test_nonfinite_gradient_skips_the_step(corpus_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(corpus_dir, tmp_path, ["train.on_nonfinite=skip"])
    trainer.train_step()
    poison(trainer)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    result = trainer.train_step()
    assert result.skipped and not math.isfinite(result.grad_norm)
    assert trainer.step == 2  # the step is consumed (data and schedule move on), the weights are not touched
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)


def test_nonfinite_gradient_stops_when_asked(corpus_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(corpus_dir, tmp_path, ["train.on_nonfinite=stop"])
    poison(trainer)
    with pytest.raises(NonFiniteError, match="non-finite gradient norm"):
        trainer.train_step()
