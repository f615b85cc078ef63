"""A tiny regression model that misbehaves on request, for the fault tests (via model.target).

kwargs: step_sleep slows every training forward (sleeping, not computing, so slow runs cost no
CPU); fail_at / fail_rank raise at that training forward of that rank while
TORCHELASTIC_RESTART_COUNT < fail_restarts; nan_at / nan_rank make that forward's loss NaN;
record_dir gets one line per training forward and rank with a checksum of the parameters;
extra_params adds a parameter of that many floats (its gradient is all-reduced like any other)
to make the all-reduce bigger.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn as nn


class FaultyRegressor(nn.Module):
    def __init__(self, dim: int, step_sleep: float, fail_at: int | None, fail_rank: int, fail_restarts: int,
                 nan_at: int | None, nan_rank: int, record_dir: str | None, extra_params: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 1))
        self.extra = nn.Parameter(torch.zeros(extra_params)) if extra_params else None
        self.step_sleep, self.fail_at, self.fail_rank, self.fail_restarts = step_sleep, fail_at, fail_rank, fail_restarts
        self.nan_at, self.nan_rank = nan_at, nan_rank
        self.rank = int(os.environ.get("RANK", "0"))
        self.forwards = 0
        self.record = None
        if record_dir:
            Path(record_dir).mkdir(parents=True, exist_ok=True)
            self.record = Path(record_dir) / f"params-rank{self.rank}-pid{os.getpid()}.txt"

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.extra is not None:
            loss = loss + 0.0 * self.extra.sum()
        if not self.training:
            return loss
        self.forwards += 1
        if self.record is not None:
            checksum = sum(float(p.detach().double().sum()) for p in self.parameters())
            with open(self.record, "a") as f:
                f.write(f"{self.forwards} {checksum!r}\n")
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.fail_at == self.forwards and self.rank == self.fail_rank and restarts < self.fail_restarts:
            raise RuntimeError(f"injected failure at forward {self.forwards} on rank {self.rank}")
        if self.nan_at == self.forwards and self.rank == self.nan_rank:
            loss = loss * float("nan")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss


def build_model(dim: int = 8, step_sleep: float = 0.0, fail_at: int | None = None, fail_rank: int = 0,
                fail_restarts: int = 1, nan_at: int | None = None, nan_rank: int = 0, record_dir: str | None = None,
                extra_params: int = 0) -> nn.Module:
    return FaultyRegressor(dim, step_sleep, fail_at, fail_rank, fail_restarts, nan_at, nan_rank, record_dir, extra_params)
