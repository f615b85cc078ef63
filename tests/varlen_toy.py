"""Data that default batching could not train on before data.collate: bare-tensor items, variable-length token samples.

Used through data.target / model.target by tests/dist/test_collate_dist.py and the unit tests.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import Dataset


class BareTensors(Dataset):
    """n items, each one bare 1-D float tensor: dim features, then the value to predict from them."""

    def __init__(self, n: int, dim: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, dim, generator=g)
        self.rows = torch.cat([x, x @ torch.randn(dim, 1, generator=g)], dim=1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


class TakesOneTensor(nn.Module):
    """forward(rows): the (B, dim + 1) batch of BareTensors as its one argument."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Linear(dim, 1)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(rows[:, :-1]), rows[:, -1:])


class VarLenTokens(Dataset):
    """n token sequences of min_len..max_len ids below vocab, each drawn from its index (the same on every rank)."""

    def __init__(self, n: int, vocab: int, min_len: int, max_len: int, seed: int) -> None:
        self.n, self.vocab, self.min_len, self.max_len, self.seed = n, vocab, min_len, max_len, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
        return torch.randint(0, self.vocab, (length,), generator=g)


def bare_datasets(n: int = 64, dim: int = 4) -> tuple[Dataset, Dataset]:
    return BareTensors(n, dim, seed=0), BareTensors(16, dim, seed=1)


def bare_model(dim: int = 4) -> nn.Module:
    return TakesOneTensor(dim)


def varlen_datasets(n: int = 64, vocab: int = 64, min_len: int = 3, max_len: int = 33) -> tuple[Dataset, Dataset]:
    return VarLenTokens(n, vocab, min_len, max_len, seed=0), VarLenTokens(16, vocab, min_len, max_len, seed=1)
