"""A user model (via model.target, with data.target=toy:build_datasets) that pauses where a test says.

At each training forward call listed in `gates` it writes gate_dir/waiting-<call> and waits until
gate_dir/go-<call> exists, so a test can stop a tracker server at an exact point of a run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn as nn


class GatedRegressor(nn.Module):
    def __init__(self, dim: int, gates: list[int], gate_dir: str) -> None:
        super().__init__()
        self.net = nn.Linear(dim, 1)
        self.gates, self.gate_dir, self.calls = set(gates), Path(gate_dir), 0

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls in self.gates:
                (self.gate_dir / f"waiting-{self.calls}").write_text("")
                deadline = time.monotonic() + 300  # bounded: a test that died must not leave this waiting
                while not (self.gate_dir / f"go-{self.calls}").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
        return nn.functional.mse_loss(self.net(x), y)


def build_gated_model(dim: int = 8, gates: list[int] | None = None, gate_dir: str = ".") -> nn.Module:
    return GatedRegressor(dim, gates or [], gate_dir)
