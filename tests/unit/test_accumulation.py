"""k accumulated micro-batches give the same update as one batch k times larger."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_trainer


def train_params(corpus: Path, run_dir: Path, micro: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    trainer = make_trainer(corpus, run_dir, [f"data.micro_batch_size={micro}", "train.global_batch_size=16"])
    assert trainer.accum == 16 // micro
    losses = [float(trainer.train_step().loss) for _ in range(steps)]
    return losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_accumulated_micro_batches_equal_one_large_batch(corpus_dir: Path, tmp_path: Path) -> None:
    losses_4x4, params_4x4 = train_params(corpus_dir, tmp_path / "a", micro=4, steps=4)
    losses_1x16, params_1x16 = train_params(corpus_dir, tmp_path / "b", micro=16, steps=4)
    assert losses_4x4 == pytest.approx(losses_1x16, rel=1e-5)
    for name, value in params_1x16.items():
        torch.testing.assert_close(params_4x4[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert losses_4x4[-1] < losses_4x4[0]  # and it learns
