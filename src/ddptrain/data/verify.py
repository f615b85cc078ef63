"""A prepared corpus's bytes checked against its meta.json, once per process, before training or evaluating.

meta.json records every shard's SHA-256 and (format 3) its largest token id. Without this check two
ranks handed shards with different bytes under the same meta.json passed the every-rank identity
check (it compares meta.json's hashes) and trained on different data, and a shard holding an id
outside the vocabulary failed at the first step with an IndexError (exit 1, restarted by launchers).

Every process verifies the files it will itself memory-map: one streaming pass per shard, computing
the SHA-256 and the largest token id together, remembered for the process's lifetime (by device,
inode, size and modification time) so that a second dataset or identity over the same corpus costs
nothing. Each rank verifies its own rather than one per node: a rank then proves what it reads (a
per-rank data.dir, a node-local copy), no new collective joins the start-up protocol, and the ranks
of a node hash in parallel from one page cache, so the wall time is one pass.

The recorded largest id gives a check that reads nothing (an id at or above vocab_size is refused
before the pass); the pass still compares it with the bytes, so a meta.json that lies about it is
refused too. Format 2 corpora have no recorded id: the pass's own is checked against the vocabulary.
A legacy corpus (train.bin, val.bin) is checked against the one SHA-256 it recorded, of both files' bytes.
Instruction data's loss masks (data/sft.py) are checked alike: their SHA-256, and every byte below 4
(the mask's two bits).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from ddptrain.errors import DataError

_CHUNK = 1 << 22  # 4 MiB: a multiple of every item size
MASK_VALUES = 4  # a loss mask's bytes hold two bits (data/sft.py: LOSS, START)
_verified: set[tuple[Any, ...]] = set()


def verify_corpus(data_dir: Path, meta: dict[str, Any]) -> None:
    """DataError naming the first shard whose bytes do not hash to meta.json's SHA-256 or that holds a token
    id at or above vocab_size; meta is read_meta(data_dir)'s (validated, sizes checked)."""
    vocab, dtype = int(meta["vocab_size"]), np.dtype(meta["dtype"])
    if meta["format"] == 1:  # legacy: one SHA-256 of train.bin's bytes followed by val.bin's
        groups = [([data_dir / "train.bin", data_dir / "val.bin"], meta["sha256"], None, vocab, dtype)]
    else:
        shards = [s for split in ("train", "val") for s in meta["shards"][split]]
        groups = [([data_dir / s["file"]], s["sha256"], s.get("max_token_id"), vocab, dtype) for s in shards]
        masks = [s["mask"] for s in shards if s.get("mask")]
        groups += [([data_dir / m["file"]], m["sha256"], None, MASK_VALUES, np.dtype(np.uint8)) for m in masks]
    for paths, sha256, recorded, below, item in groups:
        _verify_group(paths, sha256, recorded, below, item)


def _verify_group(paths: list[Path], sha256: str, recorded: int | None, vocab: int, dtype: np.dtype) -> None:
    key = (sha256, recorded, vocab, dtype.str, *(_identity(p) for p in paths))
    if key in _verified:
        return
    digest, top = _scan(paths, dtype)
    names = " + ".join(str(p) for p in paths)
    if digest != sha256:
        raise DataError(
            f"{names}: its bytes do not match meta.json (SHA-256 {digest[:12]}..., recorded {sha256[:12]}...); "
            "the shard was changed or damaged after prepare: prepare the corpus again"
        )
    if recorded is not None and top != recorded:
        raise DataError(f"{names}: its largest token id is {top}, meta.json records {recorded}; prepare again")
    if top >= vocab:
        raise DataError(f"{names}: token id {top} is not below vocab_size {vocab}; prepare the corpus again")
    _verified.add(key)


def _identity(path: Path) -> tuple[str, int, int, int, int]:
    st = path.stat()
    return os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _scan(paths: list[Path], dtype: np.dtype) -> tuple[str, int]:
    """(SHA-256 of the files' bytes in order, their largest token id or -1 when empty), in one streaming read."""
    digest, top = hashlib.sha256(), -1
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for path in paths:
        # O_NONBLOCK: a FIFO put in a shard's place is refused by the fstat below, never waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:  # buffered: readinto fills the chunk up to EOF
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DataError(f"{path} is not a regular file; prepare the corpus again")
            while n := f.readinto(buf):
                digest.update(view[:n])
                whole = n - n % dtype.itemsize
                if whole:
                    top = max(top, int(np.frombuffer(buf, dtype, whole // dtype.itemsize).max()))
    return digest.hexdigest(), top
