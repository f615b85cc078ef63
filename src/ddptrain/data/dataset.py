"""Memory-mapped token dataset: sample i is the i-th non-overlapping window of block_size + 1 tokens.

A split's shards are read as one sequence (shards.TokenSequence), so a window may span two shards
and the sample ids do not depend on how the corpus was cut into shards. Loading checks meta.json
and the shards' sizes; their bytes are verified by whoever trains or evaluates on them
(data/verify.py, called from the data identity and `ddptrain eval`), once per process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddptrain.data.corpus import read_meta
from ddptrain.data.sft_dataset import SftDataset
from ddptrain.data.shards import TokenSequence
from ddptrain.errors import DataError


class TokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(inputs, targets) windows over a split's token shards; every sample has a stable integer id."""

    def __init__(self, paths: list[Path], block_size: int, dtype: str = "uint8") -> None:
        self.paths = paths
        self.block_size = block_size
        self.tokens = TokenSequence(paths, np.dtype(dtype))
        # Windows do not overlap, so an index names one sample: the sampler's "no sample skipped
        # or repeated" is then a statement about these ids.
        self.num_samples = (len(self.tokens) - 1) // block_size
        if self.num_samples < 1:
            raise DataError(
                f"{paths[0].parent} holds {len(self.tokens)} tokens in this split, "
                f"fewer than block_size+1={block_size + 1}"
            )

    @property
    def tokens_per_sample(self) -> int:
        """Tokens one sample contributes to the loss (for tokens/s and MFU)."""
        return self.block_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = torch.from_numpy(self.tokens.slice(start, start + self.block_size + 1).astype(np.int64))
        return window[:-1], window[1:]


def load_split(
    data_dir: Path, split: str, block_size: int, meta: dict[str, Any] | None = None
) -> TokenDataset | SftDataset:
    """One split ('train' or 'val') of the prepared corpus in data_dir (meta: its read_meta, when already read):
    token windows, or one instruction record per sample when the corpus was prepared with --sft
    (data/sft_dataset.py)."""
    meta = read_meta(data_dir) if meta is None else meta
    if split not in meta["shards"]:
        raise DataError(f"{data_dir} has no split {split!r} (it has {', '.join(meta['shards'])})")
    paths = [data_dir / s["file"] for s in meta["shards"][split]]
    if meta.get("sft"):
        masks = [data_dir / s["mask"]["file"] for s in meta["shards"][split]]
        return SftDataset(paths, masks, block_size, meta["dtype"], meta["eos_id"] or 0)
    return TokenDataset(paths, block_size, meta["dtype"])
