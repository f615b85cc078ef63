"""A tiny model with metrics of its own, for custom metrics, early stopping and hooks (data: varlen_toy's bare rows).

Used through model.target / train.metrics by tests/dist/test_metrics_dist.py and tests/sync_worker.py.
`plateau` rises with the training forwards seen (a persistent buffer: a checkpoint holds it) until
`peak`, then stays: an evaluation metric whose best is known in advance, for early stopping under
mode=max (after step s of accumulation 1, it is min(s, peak)).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class PlateauModel(nn.Module):
    """forward(rows) -> {"loss": MSE, "abs_err": mean absolute error, "plateau": min(training forwards, peak),
    "pred": the predictions (an output, not a metric: not 0-dim)}."""

    def __init__(self, dim: int, peak: int) -> None:
        super().__init__()
        self.net = nn.Linear(dim, 1)
        self.peak = peak
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    def forward(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.forwards += 1
        pred = self.net(rows[:, :-1])
        err = pred - rows[:, -1:]
        plateau = self.forwards.clamp(max=self.peak).float()
        return {"loss": err.pow(2).mean(), "abs_err": err.abs().mean(), "plateau": plateau, "pred": pred}


def plateau_model(dim: int = 4, peak: int = 6) -> nn.Module:
    return PlateauModel(dim, peak)


def target_mean(outputs: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """train.metrics: the batch's mean target, beside the model's own metrics."""
    return {"target_mean": batch[:, -1].mean()}


def per_sample(outputs: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """train.metrics returning a tensor per sample, not a scalar."""
    return {"targets": batch[:, -1]}


def always_nan(outputs: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """train.metrics: a metric that is NaN at every step and evaluation (early stopping on it never improves)."""
    return {"nothing": torch.tensor(float("nan"))}
