"""Memory-mapped token dataset: sample i is the i-th non-overlapping window of block_size + 1 tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ddptrain.data.corpus import read_meta
from ddptrain.errors import DataError


class TokenDataset(Dataset):
    """(inputs, targets) windows over a uint8 token file; every sample has a stable integer id."""

    def __init__(self, path: Path, block_size: int) -> None:
        self.path = path
        self.block_size = block_size
        self.tokens = np.memmap(path, dtype=np.uint8, mode="r")
        # Windows do not overlap, so an index names one sample: the sampler's "no sample skipped
        # or repeated" is then a statement about these ids.
        self.num_samples = (len(self.tokens) - 1) // block_size
        if self.num_samples < 1:
            raise DataError(f"{path} holds {len(self.tokens)} tokens, fewer than block_size+1={block_size + 1}")

    @property
    def tokens_per_sample(self) -> int:
        """Tokens one sample contributes to the loss (for tokens/s and MFU)."""
        return self.block_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


def load_token_datasets(data_dir: Path, block_size: int) -> tuple[TokenDataset, TokenDataset]:
    """The prepared corpus's train and validation datasets."""
    read_meta(data_dir)
    return TokenDataset(data_dir / "train.bin", block_size), TokenDataset(data_dir / "val.bin", block_size)
