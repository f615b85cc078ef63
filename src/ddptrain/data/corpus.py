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

from ddptrain.data.prepare import SPLITS, CorpusInfo, PrepareOptions, prepare_corpus
from ddptrain.data.publish import META
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
    """Files named directly, through globs (** allowed) or as folders (all files below)."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) or ([pattern] if os.path.exists(pattern) else [])
        if not matches:
            raise DataError(f"no files match {pattern!r}")
        for m in map(Path, matches):
            files.extend(sorted(p for p in m.rglob("*") if p.is_file()) if m.is_dir() else [m])
    return files


def _legacy(meta: dict[str, Any]) -> dict[str, Any]:
    """A pre-shard meta.json (train.bin, val.bin of bytes) in today's form."""
    shards = {s: [{"file": f"{s}.bin", "tokens": meta[f"{s}_tokens"]}] for s in SPLITS}
    return {
        **meta,
        "format": 1,
        "dtype": "uint8",
        "tokenizer": {"kind": "bytes", "file": None, "sha256": None},
        "eos_id": None,
        "shards": shards,
    }


def _load_meta(data_dir: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((data_dir / META).read_text())
        return meta if "shards" in meta else _legacy(meta)
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None


def corpus_fingerprint(meta: dict[str, Any]) -> str | None:
    """One SHA-256 naming a prepared corpus: its tokens (each shard's SHA-256), dtype and tokenizer.

    A legacy meta.json carries its own `sha256`; None when the shards' hashes are not recorded.
    """
    if isinstance(meta.get("sha256"), str):
        return str(meta["sha256"])
    try:
        shard_hashes = [s["sha256"] for split in SPLITS for s in meta["shards"][split]]
    except (KeyError, TypeError):
        return None
    if not all(isinstance(h, str) for h in shard_hashes):
        return None
    described = [str(meta.get("dtype")), json.dumps(meta.get("tokenizer"), sort_keys=True), *shard_hashes]
    return hashlib.sha256("\n".join(described).encode()).hexdigest()


def corpus_ready(data_dir: Path) -> bool:
    """True when data_dir holds a completely prepared corpus."""
    meta = _load_meta(data_dir)
    if meta is None:
        return False
    return all((data_dir / s["file"]).is_file() for split in SPLITS for s in meta["shards"][split])


def read_meta(data_dir: Path) -> dict[str, Any]:
    """The corpus's meta.json (legacy ones in today's form), checked against the shard files beside it."""
    if not (data_dir / META).is_file():
        raise DataError(
            f"no prepared corpus in {data_dir} (meta.json is missing); run `ddptrain prepare --out {data_dir} FILES...`"
        )
    meta = _load_meta(data_dir)
    malformed = DataError(f"{data_dir / META} is malformed; prepare the corpus again")
    if not isinstance(meta, dict):
        raise malformed
    itemsize = {"uint8": 1, "uint16": 2, "uint32": 4}.get(meta.get("dtype", "uint8"))
    if itemsize is None:
        raise DataError(f"{data_dir / META}: unknown dtype {meta.get('dtype')!r}; prepare the corpus again")
    try:
        for split in SPLITS:
            for shard in meta["shards"][split]:
                name, tokens = shard["file"], shard["tokens"]
                if not (isinstance(name, str) and Path(name).name == name and isinstance(tokens, int)):
                    raise malformed  # only plain file names beside meta.json: nothing read outside data.dir
                path = data_dir / name
                if not path.is_file():
                    raise DataError(f"{path} is missing; prepare the corpus again")
                if path.stat().st_size != tokens * itemsize:
                    raise DataError(
                        f"{path} holds {path.stat().st_size} bytes, meta.json says "
                        f"{tokens} tokens of {itemsize} byte(s); prepare again"
                    )
    except (KeyError, TypeError, AttributeError):
        raise malformed from None
    return meta
