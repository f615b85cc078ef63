"""Instruction data as samples: one record per sample, its loss mask turned into labels.

A split's tokens and masks (data/sft.py: bit LOSS on answer tokens, bit START on each record's first
token) are memory-mapped as one sequence each, like the pre-training corpus. Sample i is the i-th
usable record: its first block_size + 1 tokens (a longer record is truncated), right-padded to
block_size + 1 with the corpus's end-of-document id (0 for raw bytes). It is a mapping:
`input_ids`, `labels` (the token where the mask says answer, -100 elsewhere and on padding) and
`attention_mask` (0 on padding), aligned as in transformers; the built-in GPT and the transformers
models shift the labels by one themselves, so the sample trains block_size targets at most.

A record is usable when an answer token falls at positions 1..block_size (position 0 has no
context to predict it from): a record whose prompt alone fills the block would contribute no target
and is skipped, counted in a warning. Finding the records reads the masks once, in chunks: the
memory is one start and one length per record, never one entry per token.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ddptrain.data.collate import IGNORE_INDEX
from ddptrain.data.sft import LOSS, START
from ddptrain.data.shards import TokenSequence
from ddptrain.errors import DataError

log = logging.getLogger(__name__)
_CHUNK = 1 << 24  # mask bytes read at a time while finding the records


class SftDataset(Dataset[dict[str, torch.Tensor]]):
    """One instruction record per sample (input_ids, labels, attention_mask of block_size + 1); stable ids."""

    def __init__(
        self, paths: list[Path], mask_paths: list[Path], block_size: int, dtype: str = "uint8", pad_id: int = 0
    ) -> None:
        self.block_size, self.pad_id = block_size, pad_id
        self.tokens = TokenSequence(paths, np.dtype(dtype))
        self.mask = TokenSequence(mask_paths, np.dtype(np.uint8))
        starts = _record_starts(self.mask)
        ends = np.append(starts[1:], len(self.mask))
        window_ends = np.minimum(ends, starts + block_size + 1)
        targets = _loss_before(self.mask, window_ends) - _loss_before(self.mask, starts + 1)
        usable = targets > 0
        self.starts, self.lengths = starts[usable], (window_ends - starts)[usable]
        skipped = len(starts) - len(self.starts)
        if skipped:
            log.warning(
                "%s: %d of %d records have no answer token within block_size + 1 = %d tokens; skipped",
                paths[0].parent if paths else "?",
                skipped,
                len(starts),
                block_size + 1,
            )
        if not len(self.starts):
            raise DataError(
                f"{paths[0].parent if paths else '?'}: no record of this split has an answer token within "
                f"block_size + 1 = {block_size + 1} tokens; raise model.block_size or shorten the prompts"
            )

    @property
    def tokens_per_sample(self) -> int:
        """Positions one sample runs through the model (for tokens/s and MFU)."""
        return self.block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, n = int(self.starts[index]), int(self.lengths[index])
        ids = torch.from_numpy(self.tokens.slice(start, start + n).astype(np.int64))
        answer = torch.from_numpy((self.mask.slice(start, start + n) & LOSS).astype(bool))
        size = self.block_size + 1
        input_ids = torch.full((size,), self.pad_id, dtype=torch.long)
        labels = torch.full((size,), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(size, dtype=torch.long)
        input_ids[:n] = ids
        labels[:n] = torch.where(answer, ids, IGNORE_INDEX)
        attention_mask[:n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def _record_starts(mask: TokenSequence) -> np.ndarray:
    """Positions of the START bits: every record's first token, in order."""
    found = [
        np.flatnonzero(mask.slice(lo, min(lo + _CHUNK, len(mask))) & START) + lo for lo in range(0, len(mask), _CHUNK)
    ]
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


def _loss_before(mask: TokenSequence, positions: np.ndarray) -> np.ndarray:
    """For each position p (ascending), how many answer tokens lie in [0, p): one chunked pass over the mask."""
    out = np.zeros(len(positions), np.int64)
    seen = 0
    for lo in range(0, len(mask), _CHUNK):
        answers = np.cumsum(mask.slice(lo, min(lo + _CHUNK, len(mask))) & LOSS, dtype=np.int64)
        hi = lo + len(answers)
        first, last = np.searchsorted(positions, [lo, hi], side="right")
        # positions in (lo, hi]: the answers of this chunk before them, plus those of earlier chunks
        out[first:last] = seen + answers[positions[first:last] - lo - 1]
        seen += int(answers[-1]) if len(answers) else 0
        out[last:] = seen
    return out
