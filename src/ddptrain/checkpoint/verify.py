"""Verification: a checkpoint is loaded only when every byte that is read matches its manifest.

verify_checkpoint checks the folder (a real folder, not a link), the manifest (checksum, types,
plain names, the files its writer requires) and every listed file (a regular file, not a link,
the recorded size and SHA-256). VerifiedCheckpoint.load then reads only files the manifest lists
and checks their bytes again as it reads them, so a file swapped after verification is refused.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddptrain.checkpoint.manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest, ManifestError, parse_manifest, step_of
from ddptrain.checkpoint.writer import WRITERS
from ddptrain.errors import CheckpointError
from ddptrain.safe_files import read_bytes_no_follow

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint folder whose manifest and files were verified; load() reads only what it lists."""

    path: Path
    manifest: Manifest

    @property
    def step(self) -> int:
        """The step the checkpoint was taken after."""
        return self.manifest.step

    def load(self, name: str) -> Any:
        """One listed file onto the CPU (torch.load, weights_only), its bytes checked against the manifest."""
        entry = self.manifest.files.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path.name}: {name} is not listed in its {MANIFEST}")
        try:
            data = read_bytes_no_follow(self.path / name, entry.size)
        except OSError as e:
            raise CheckpointError(f"{self.path.name}: cannot read {name} ({e.strerror or e})") from None
        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CheckpointError(f"{self.path.name}: {name} changed after it was verified")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # verified bytes torch cannot read: a format problem, reported in one line
            raise CheckpointError(
                f"{self.path.name}: {name} cannot be loaded ({type(e).__name__}: {str(e)[:120]})"
            ) from None


def read_manifest(path: Path) -> Manifest:
    """The parsed manifest of a checkpoint folder (no file checked yet); ManifestError when malformed."""
    try:
        data = read_bytes_no_follow(path / MANIFEST, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(f"{MANIFEST} is missing") from None
    except OSError as e:
        raise ManifestError(f"{MANIFEST} is unreadable ({e.strerror or e})") from None
    return parse_manifest(data)


def _sha256_file(path: Path, size: int) -> tuple[int, str]:
    """(size, SHA-256) of a regular file read without following a link; at most size + 1 bytes are read."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(21, "not a regular file")
        if st.st_size != size:
            return st.st_size, ""
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
        return st.st_size, h.hexdigest()


def verify_checkpoint(path: Path) -> VerifiedCheckpoint:
    """The checkpoint at path, verified; CheckpointError (one line, naming the folder) when anything is off."""
    try:
        return _verify(path)
    except CheckpointError as e:
        raise type(e)(f"{path.name}: {e}") from None


def _verify(path: Path) -> VerifiedCheckpoint:
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError("not a checkpoint folder (missing, or a symbolic link)")
    manifest = read_manifest(path)
    named_step = step_of(path.name)
    if named_step is not None and named_step != manifest.step:
        raise ManifestError(f"{MANIFEST} is of step {manifest.step}, not of the folder's step {named_step} (renamed?)")
    writer = WRITERS.get(manifest.writer)
    if writer is None:
        raise ManifestError(f"{MANIFEST} names an unknown writer {manifest.writer[:40]!r}")
    missing = sorted(writer.required(manifest.world_size) - set(manifest.files))
    if missing:
        raise ManifestError(f"{MANIFEST} does not list {', '.join(missing[:4])} (required to resume)")
    for name, entry in sorted(manifest.files.items()):
        try:
            size, sha = _sha256_file(path / name, entry.size)
        except FileNotFoundError:
            raise CheckpointError(f"file {name} is missing") from None
        except OSError as e:
            raise CheckpointError(f"file {name} is not a readable regular file ({e.strerror or e})") from None
        if size != entry.size:
            raise CheckpointError(f"file {name} has {size} bytes, the manifest says {entry.size} (truncated?)")
        if sha != entry.sha256:
            raise CheckpointError(f"file {name} does not match its SHA-256 in the manifest (corrupted)")
    return VerifiedCheckpoint(path, manifest)
