"""A model and dataset the package does not define, used through model.target / data.target.

The dataset's items carry their sample id, and the model appends the ids it trains on to a file
per rank, so tests can check which samples a run consumed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import Dataset


class IdDataset(Dataset):
    """n samples of (id, x, y) with y a fixed linear function of x plus noise."""

    def __init__(self, n: int, dim: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tensor(i), self.x[i], self.y[i]


def build_datasets(n: int = 256, dim: int = 8) -> tuple[Dataset, Dataset]:
    return IdDataset(n, dim, seed=0), IdDataset(64, dim, seed=1)


class TaggedIdDataset(IdDataset):
    """IdDataset whose sample i has id tag * 1000 + i: a mixture's records show which source gave it."""

    def __init__(self, tag: int, n: int, dim: int) -> None:
        super().__init__(n, dim, seed=tag)
        self.tag = tag

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, x, y = super().__getitem__(i)
        return torch.tensor(self.tag * 1000 + i), x, y


def build_tagged_datasets(tag: int, n: int, dim: int = 8) -> tuple[Dataset, Dataset]:
    """Source `tag` of a mixture (n training samples, 8 validation samples)."""
    return TaggedIdDataset(tag, n, dim), TaggedIdDataset(tag, 8, dim)


class RecordingRegressor(nn.Module):
    """Records the ids it trains on; with die_at, rank 0 SIGKILLs itself at its die_at-th training forward,
    once (the marker file remembers), before recording that micro-batch."""

    def __init__(self, dim: int, record_dir: str | None, die_at: int = 0, marker: str = "") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 1))
        self.record = None
        if record_dir:
            Path(record_dir).mkdir(parents=True, exist_ok=True)
            self.record = Path(record_dir) / f"ids-rank{os.environ.get('RANK', '0')}-pid{os.getpid()}.txt"
        self.armed = die_at > 0 and os.environ.get("RANK", "0") == "0" and not Path(marker).exists()
        self.die_at, self.marker, self.calls = die_at, Path(marker), 0

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.armed and self.calls == self.die_at:
                self.marker.write_text(str(self.calls))
                os.kill(os.getpid(), signal.SIGKILL)
        if self.record is not None and self.training:
            with open(self.record, "a") as f:
                f.write(" ".join(map(str, ids.tolist())) + "\n")
        return nn.functional.mse_loss(self.net(x), y)


def build_model(dim: int = 8, record_dir: str | None = None, die_at: int = 0, marker: str = "") -> nn.Module:
    return RecordingRegressor(dim, record_dir, die_at, marker)


class KillableGPT(nn.Module):
    """The built-in GPT that SIGKILLs its own process at its n-th training forward, once.

    A marker file records that the kill happened, so the restarted run trains through. This
    puts a real SIGKILL at an exact point: mid gradient accumulation, or right before a save.
    """

    def __init__(self, gpt: nn.Module, die_at_call: int, marker: str, rank: int) -> None:
        super().__init__()
        self.gpt = gpt
        self.calls = 0
        self.armed = int(os.environ.get("RANK", "0")) == rank and not Path(marker).exists()
        self.die_at_call, self.marker = die_at_call, Path(marker)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.armed and self.calls == self.die_at_call:
                self.marker.write_text(str(self.calls))
                os.kill(os.getpid(), signal.SIGKILL)
        return self.gpt(idx, targets)

    def flops_per_token(self) -> float:
        return self.gpt.flops_per_token()


def build_killable_gpt(die_at_call: int, marker: str, rank: int = 0, **gpt: object) -> nn.Module:
    from ddptrain.config import ModelConfig
    from ddptrain.models.gpt import GPT

    return KillableGPT(GPT(ModelConfig(**gpt)), die_at_call, marker, rank)
