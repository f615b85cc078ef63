"""Prepare a byte-level token corpus into memory-mapped train/val files.

The default corpus is the Python standard library's own `.py` sources (about 12 MB on every
machine with Python), so the first run needs no download. Bytes are the tokens (vocab 256):
no tokenizer to train or ship, and any text file works.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddptrain.errors import DataError

META = "meta.json"
SPLITS = ("train", "val")
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, tests and installed packages excluded, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def expand_sources(patterns: list[str]) -> list[Path]:
    """Files named directly, through globs (** allowed) or as folders (all files below)."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) or ([pattern] if os.path.exists(pattern) else [])
        if not matches:
            raise DataError(f"no files match {pattern!r}")
        for m in map(Path, matches):
            files.extend(sorted(p for p in m.rglob("*") if p.is_file()) if m.is_dir() else [m])
    return files


@dataclass(frozen=True)
class CorpusInfo:
    """What `prepare` wrote."""

    out_dir: Path
    files: int
    train_tokens: int
    val_tokens: int


def prepare_corpus(sources: list[Path], out_dir: Path, val_fraction: float) -> CorpusInfo:
    """Concatenate the files' bytes, split off the last val_fraction for validation, write atomically."""
    if not sources:
        raise DataError("no source files to prepare")
    digest = hashlib.sha256()
    chunks = []
    for path in sources:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None
        digest.update(data)
        chunks.append(np.frombuffer(data, dtype=np.uint8))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    n_val = int(len(tokens) * val_fraction)
    if len(tokens) - n_val < 1024 or n_val < 256:
        raise DataError(f"corpus too small: {len(tokens)} bytes from {len(sources)} file(s); need at least ~8 KB")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = {"train": tokens[: len(tokens) - n_val], "val": tokens[len(tokens) - n_val :]}
    for split, arr in parts.items():
        tmp = out_dir / f".{split}.bin.{os.getpid()}.tmp"
        arr.tofile(tmp)
        os.replace(tmp, out_dir / f"{split}.bin")
    meta = {
        "vocab_size": 256,
        "dtype": "uint8",
        "files": len(sources),
        "train_tokens": int(len(parts["train"])),
        "val_tokens": int(len(parts["val"])),
        "sha256": digest.hexdigest(),
    }
    # meta.json is written last: its presence marks a complete corpus.
    tmp = out_dir / f".{META}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out_dir / META)
    return CorpusInfo(out_dir, len(sources), meta["train_tokens"], meta["val_tokens"])


def corpus_ready(data_dir: Path) -> bool:
    """True when data_dir holds a completely prepared corpus."""
    return (data_dir / META).is_file() and all((data_dir / f"{s}.bin").is_file() for s in SPLITS)


def read_meta(data_dir: Path) -> dict:
    """The corpus's meta.json, checked against the files beside it."""
    if not corpus_ready(data_dir):
        raise DataError(
            f"no prepared corpus in {data_dir} (need meta.json, train.bin, val.bin); "
            f"run `ddptrain prepare --out {data_dir} FILES...`"
        )
    try:
        meta = json.loads((data_dir / META).read_text())
        sizes = {s: meta[f"{s}_tokens"] for s in SPLITS}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{data_dir / META} is malformed ({e}); prepare the corpus again") from None
    for split, n in sizes.items():
        actual = (data_dir / f"{split}.bin").stat().st_size
        if actual != n:
            raise DataError(f"{data_dir / f'{split}.bin'} holds {actual} bytes, meta.json says {n}; prepare again")
    return meta
