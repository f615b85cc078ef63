"""Where corpora come from and how a prepared one is found and checked.

The default corpus is the Python standard library's own `.py` sources (about 12 MB on every
machine with Python), so the first run needs no download. Preparing is in prepare.py; a prepared
folder holds token shards and `meta.json` (written last). Folders from before shards existed
(`train.bin`, `val.bin`, uint8 bytes) still load.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Any

from ddptrain.data.meta import ITEMSIZE, read_meta_file
from ddptrain.data.prepare import SPLITS, CorpusInfo, PrepareOptions, prepare_corpus
from ddptrain.data.tables import saved_dataset_files
from ddptrain.errors import DataError

__all__ = [
    "CorpusInfo",
    "PrepareOptions",
    "prepare_corpus",
    "corpus_ready",
    "read_meta",
    "expand_sources",
    "stdlib_sources",
]
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, tests and installed packages excluded, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def expand_sources(patterns: list[str]) -> list[Path]:
    """Files named directly, through globs (** allowed) or as folders (all files below, or the Arrow files of
    a folder saved by Hugging Face `datasets`)."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) or ([pattern] if os.path.exists(pattern) else [])
        if not matches:
            raise DataError(f"no files match {pattern!r}")
        for m in map(Path, matches):
            if m.is_dir():
                saved = saved_dataset_files(m)  # a folder `datasets` saved: its Arrow files, not its JSON
                files.extend(saved if saved is not None else sorted(p for p in m.rglob("*") if p.is_file()))
            else:
                files.append(m)
    return files


def corpus_fingerprint(meta: dict[str, Any]) -> str | None:
    """One SHA-256 naming a prepared corpus: its tokens (each shard's SHA-256), dtype and tokenizer.

    A legacy meta.json carries its own `sha256`; None when the shards' hashes are not recorded.
    """
    if isinstance(meta.get("sha256"), str):
        return str(meta["sha256"])
    try:
        shards = [s for split in SPLITS for s in meta["shards"][split]]
        shard_hashes = [s["sha256"] for s in shards] + [s["mask"]["sha256"] for s in shards if s.get("mask")]
    except (KeyError, TypeError):
        return None
    if not all(isinstance(h, str) for h in shard_hashes):
        return None
    described = [str(meta.get("dtype")), json.dumps(meta.get("tokenizer"), sort_keys=True), *shard_hashes]
    return hashlib.sha256("\n".join(described).encode()).hexdigest()


def corpus_ready(data_dir: Path) -> bool:
    """True when data_dir holds a completely prepared corpus (a valid meta.json and every file it lists)."""
    try:
        read_meta(data_dir)
    except (DataError, OSError):
        return False
    return True


def read_meta(data_dir: Path) -> dict[str, Any]:
    """The corpus's meta.json, validated (data/meta.py; legacy ones in today's form) and checked against the
    sizes of the shard files beside it. Their bytes are data/verify.py's (read once per process)."""
    meta = read_meta_file(data_dir)
    itemsize = ITEMSIZE[meta["dtype"]]
    for split in SPLITS:
        for shard in meta["shards"][split]:
            # plain names (the schema): inside data.dir
            _check_size(data_dir / shard["file"], shard["tokens"], itemsize)
            if shard.get("mask"):
                _check_size(data_dir / shard["mask"]["file"], shard["tokens"], 1)
    return meta


def _check_size(path: Path, tokens: int, itemsize: int) -> None:
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "is missing"
        raise DataError(f"{path} {what}; prepare the corpus again")
    if path.stat().st_size != tokens * itemsize:
        raise DataError(
            f"{path} holds {path.stat().st_size} bytes, meta.json says {tokens} tokens of {itemsize} byte(s); prepare again"
        )
