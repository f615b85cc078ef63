"""User models (via model.target) that misbehave on purpose: a straggler rank and a failing rank.

Use them with data.target=toy:build_datasets.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class SlowOnOneRank(nn.Module):
    """Sleeps sleep_s in every training forward on slow_rank."""

    def __init__(self, dim: int, slow_rank: int, sleep_s: float) -> None:
        super().__init__()
        self.net = nn.Linear(dim, 1)
        self.sleep_s = sleep_s if _rank() == slow_rank else 0.0

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.sleep_s and self.training:
            time.sleep(self.sleep_s)
        return nn.functional.mse_loss(self.net(x), y)


class FailsOnOneRank(nn.Module):
    """Raises RuntimeError in the fail_after-th training forward on fail_rank."""

    def __init__(self, dim: int, fail_rank: int, fail_after: int) -> None:
        super().__init__()
        self.net = nn.Linear(dim, 1)
        self.fail_rank, self.fail_after, self.calls = fail_rank, fail_after, 0

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        if _rank() == self.fail_rank and self.calls >= self.fail_after:
            raise RuntimeError(f"deliberate failure on rank {self.fail_rank} in forward call {self.calls}")
        return nn.functional.mse_loss(self.net(x), y)


def build_slow_model(dim: int = 8, slow_rank: int = 1, sleep_s: float = 0.05) -> nn.Module:
    return SlowOnOneRank(dim, slow_rank, sleep_s)


def build_failing_model(dim: int = 8, fail_rank: int = 0, fail_after: int = 3) -> nn.Module:
    return FailsOnOneRank(dim, fail_rank, fail_after)


class BusyModel(nn.Module):
    """Real compute (no sleeping), so that a SIGSTOP duty cycle on its process slows it in proportion."""

    def __init__(self, dim: int, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(self.out(h), y)


def build_busy_model(dim: int = 8, width: int = 256, depth: int = 4) -> nn.Module:
    return BusyModel(dim, width, depth)
