"""A model and dataset that ddptrain does not define: an MLP fitting a noisy nonlinear function.

Run it with:
    PYTHONPATH=examples/regression ddptrain train -c examples/regression/config.yaml
    PYTHONPATH=examples/regression torchrun --nproc-per-node 2 -m ddptrain train -c examples/regression/config.yaml
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import Dataset


class WavesDataset(Dataset):
    """y = sin(3 x0) * cos(2 x1) + 0.5 x2^2 + noise, for x uniform in [-1, 1]^dim."""

    def __init__(self, n: int, dim: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, dim, generator=g) * 2 - 1
        clean = torch.sin(3 * self.x[:, 0]) * torch.cos(2 * self.x[:, 1]) + 0.5 * self.x[:, 2] ** 2
        self.y = (clean + 0.05 * torch.randn(n, generator=g)).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def build_datasets(n_train: int = 8192, n_val: int = 1024, dim: int = 4) -> tuple[Dataset, Dataset]:
    """The protocol's data factory: (train, val)."""
    return WavesDataset(n_train, dim, seed=0), WavesDataset(n_val, dim, seed=1)


class MLP(nn.Module):
    """The protocol's model: forward(**batch) returns the mean loss of the batch."""

    def __init__(self, dim: int, hidden: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(dim if i == 0 else hidden, hidden), nn.SiLU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)

    def flops_per_token(self) -> float:
        """Training FLOPs per sample (6 x parameters): lets ddptrain report achieved FLOP/s."""
        return 6.0 * sum(p.numel() for p in self.parameters())


def build_model(dim: int = 4, hidden: int = 64, depth: int = 3) -> nn.Module:
    """The protocol's model factory."""
    return MLP(dim, hidden, depth)
