"""Token shards: fixed-size files written atomically, and read back as one memory-mapped sequence.

A split is `{split}-00000.bin`, `{split}-00001.bin`, ...: every shard holds exactly `shard_tokens`
tokens except the last. A shard is written under a temporary name, fsynced and renamed, so a shard
that exists under its final name is complete. Instruction data (data/sft.py) has a loss mask beside
each token shard, `{split}-00000.mask`: one byte per token, cut at the same token counts.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from ddptrain.safe_files import open_new_no_follow

MASK_SUFFIX = ".mask"


def shard_name(split: str, index: int, suffix: str = ".bin") -> str:
    """File name of a split's index-th shard (of tokens; of loss masks with MASK_SUFFIX)."""
    return f"{split}-{index:05d}{suffix}"


class ShardWriter:
    """Appends tokens to a split, cutting shards of exactly shard_tokens tokens."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype, suffix: str = ".bin") -> None:
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, dtype
        self.suffix = suffix
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._tmp: Path | None = None
        self._hash = hashlib.sha256()
        self._filled = 0
        self._max = 0

    @property
    def tokens(self) -> int:
        """Tokens written so far."""
        return sum(int(s["tokens"]) for s in self.shards) + self._filled

    def append(self, tokens: np.ndarray) -> None:
        """Write tokens, closing each shard as it fills."""
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                self._open()
            take = min(len(tokens), self.shard_tokens - self._filled)
            data = tokens[:take].tobytes()
            if take:  # recorded in meta.json: the range check at load reads this, not the shard
                self._max = max(self._max, int(tokens[:take].max()))
            self._file.write(data)
            self._hash.update(data)
            self._filled += take
            tokens = tokens[take:]
            if self._filled == self.shard_tokens:
                self._close()

    def finish(self) -> list[dict[str, Any]]:
        """Close the last (partial) shard; the list of shards with their token counts, SHA-256 and largest id."""
        if self._file is not None and self._filled:
            self._close()
        elif self._file is not None:
            self._file.close()
            assert self._tmp is not None
            self._tmp.unlink()
            self._file = None
        return self.shards

    def _open(self) -> None:
        name = shard_name(self.split, len(self.shards), self.suffix)
        self._tmp = self.out_dir / f".{name}.{os.getpid()}.tmp"
        self._file = open_new_no_follow(self._tmp)  # a fresh name in the preparer's private folder
        self._hash = hashlib.sha256()
        self._filled = 0
        self._max = 0

    def _close(self) -> None:
        assert self._tmp is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = shard_name(self.split, len(self.shards), self.suffix)
        os.replace(self._tmp, self.out_dir / name)
        shard = {"file": name, "tokens": self._filled, "sha256": self._hash.hexdigest(), "max_token_id": self._max}
        self.shards.append(shard)
        self._file, self._tmp, self._filled = None, None, 0


class TokenSequence:
    """Several token files memory-mapped and addressed as one sequence."""

    def __init__(self, paths: list[Path], dtype: np.dtype) -> None:
        self.dtype = dtype
        self.maps = [np.memmap(p, dtype=dtype, mode="r") for p in paths if p.stat().st_size]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop), joined across shard boundaries when the range spans them."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        i = first
        while start < stop:
            lo = start - int(self.starts[i])
            take = min(stop - start, len(self.maps[i]) - lo)
            parts.append(self.maps[i][lo : lo + take])
            start += take
            i += 1
        if not parts:
            return np.zeros(0, self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
