"""Verification: a checkpoint is used only when every byte of every file it lists matches its manifest.

verify_checkpoint checks the folder (a real folder, not a link), the manifest (checksum, types,
plain names, the files its writer requires) and every listed file (a regular file, not a link,
the recorded size and digest, of the algorithm the manifest names). It reads each file once: its writer decodes the bytes while they
are hashed (HashingReader, hashing_reader.py), one thread per file, and the decoded contents are kept in the
VerifiedCheckpoint only once every file's hash has matched. Nothing decoded from a file is handed
out before then, so verification and loading are one pass and a mismatch falls back exactly as
before. A VerifiedCheckpoint built from a manifest alone (another rank's decision) reads and
verifies the folder the same way on first use, and refuses a folder whose manifest changed.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddptrain.checkpoint.digests import SHOWN
from ddptrain.checkpoint.formats.base import CheckpointFormat
from ddptrain.checkpoint.formats.registry import format_named
from ddptrain.checkpoint.hashing_reader import HashingReader
from ddptrain.checkpoint.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    ManifestError,
    disk_name,
    parse_manifest,
    step_of,
)
from ddptrain.errors import CheckpointError
from ddptrain.safe_files import open_regular, read_bytes_no_follow

_MAX_THREADS = 8


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint folder whose manifest and files were verified, with the decoded contents of its files.

    contents is None for a checkpoint named by another rank: the first content() reads and verifies it.
    """

    path: Path
    manifest: Manifest
    contents: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def step(self) -> int:
        """The step the checkpoint was taken after."""
        return self.manifest.step

    @property
    def writer(self) -> CheckpointFormat:
        """The format that wrote (and so reads) this checkpoint."""
        writer = format_named(self.manifest.writer)
        if writer is None:
            raise CheckpointError(f"{self.path.name}: written by an unknown writer {self.manifest.writer!r}")
        return writer

    def content(self, name: str) -> Any:
        """The decoded content of one listed file (as its writer's decode returned it), verified."""
        if name not in self.manifest.files:
            raise CheckpointError(f"{self.path.name}: {name} is not listed in its {MANIFEST}")
        if self.contents is None:
            try:
                again = verify_checkpoint(self.path)
            except CheckpointError as e:
                raise CheckpointError(f"{self.path.name} changed after it was verified: {e}") from None
            if again.manifest != self.manifest:
                raise CheckpointError(f"{self.path.name}: its {MANIFEST} changed after it was verified")
            object.__setattr__(self, "contents", again.contents)
        assert self.contents is not None
        if name not in self.contents:  # a shared load keeps on each rank only what that rank needs
            raise CheckpointError(f"{self.path.name}: {name} was not read for this rank")
        return self.contents[name]

    def release(self) -> None:
        """Drop the decoded contents (memory; state handed out must not be handed out twice)."""
        object.__setattr__(self, "contents", None)

    def load(self, name: str) -> Any:
        """One listed torch.save file as objects on the CPU (torch.load, weights_only), from verified bytes."""
        data = self.content(name)
        if not isinstance(data, bytes):
            raise CheckpointError(f"{self.path.name}: {name} is not a torch.save file")
        return torch_load_bytes(self.path.name, name, data)

    def state(self, key: str) -> Any:
        """One shared object of the checkpoint ('model', 'optimizer', 'trainer'), whatever its format."""
        return self.writer.read_shared(self, key)


def torch_load_bytes(folder: str, name: str, data: bytes) -> Any:
    """torch.load (weights_only, onto the CPU) of verified bytes; CheckpointError in one line when torch cannot."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # verified bytes torch cannot read: a format problem, reported in one line
        raise CheckpointError(f"{folder}: {name} cannot be loaded ({type(e).__name__}: {str(e)[:120]})") from None


def read_manifest(path: Path) -> Manifest:
    """The parsed manifest of a checkpoint folder (no file checked yet); ManifestError when malformed."""
    try:
        data = read_bytes_no_follow(path / MANIFEST, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(f"{MANIFEST} is missing") from None
    except OSError as e:
        raise ManifestError(f"{MANIFEST} is unreadable ({e.strerror or e})") from None
    return parse_manifest(data)


def _read_file(path: Path, name: str, entry: FileEntry, algorithm: str, writer: CheckpointFormat, keep: bool) -> Any:
    """Read one listed file once without following a link, decoding it (keep) while hashing it."""
    on_disk = disk_name(name)
    shown = name if on_disk == name else f"{on_disk} (listed as {name})"  # messages name the file a user sees
    try:
        fd = open_regular(path / on_disk, os.O_RDONLY)  # a FIFO in its place is refused, never waited on
    except FileNotFoundError:
        raise CheckpointError(f"file {shown} is missing") from None
    except OSError as e:
        raise CheckpointError(f"file {shown} is not a readable regular file ({e.strerror or e})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        if st.st_size != entry.size:
            raise CheckpointError(f"file {shown} has {st.st_size} bytes, the manifest says {entry.size} (truncated?)")
        reader = HashingReader(f, entry.size, algorithm)
        decoded: Any = None
        problem: str | None = None
        if keep:
            try:
                decoded = writer.decode(name, reader)
            except Exception as e:  # garbage decodes badly; the hash below says whether it is corruption
                problem = f"{type(e).__name__}: {str(e)[:120]}"
        extra, digest = reader.finish()
    if extra > 0:
        raise CheckpointError(f"file {shown} grew while it was read (the manifest says {entry.size} bytes)")
    if digest != entry.digest:
        raise CheckpointError(f"file {shown} does not match its {SHOWN[algorithm]} in the manifest (corrupted)")
    if problem is not None:
        raise CheckpointError(f"file {shown} cannot be loaded ({problem})")
    return decoded


def verify_checkpoint(path: Path, keep: bool = True) -> VerifiedCheckpoint:
    """The checkpoint at path, verified; CheckpointError (one line, naming the folder) when anything is off.

    keep: decode the files into the result (one read serves verification and loading); False
    only hashes them (pruning, listing).
    """
    manifest = checked_manifest(path)
    names = sorted(manifest.files)
    contents = read_files(path, manifest, names, set(names) if keep else set())
    return VerifiedCheckpoint(path, manifest, contents if keep else None)


def checked_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint at path, checked (folder, checksum, step, writer, required files);
    no listed file is opened. CheckpointError naming the folder when anything is off."""
    try:
        if path.is_symlink() or not path.is_dir():
            raise CheckpointError("not a checkpoint folder (missing, or a symbolic link)")
        manifest = read_manifest(path)
        named_step = step_of(path.name)
        if named_step is not None and named_step != manifest.step:
            raise ManifestError(
                f"{MANIFEST} is of step {manifest.step}, not of the folder's step {named_step} (renamed?)"
            )
        writer = format_named(manifest.writer)
        if writer is None:
            raise ManifestError(f"{MANIFEST} names an unknown writer {manifest.writer[:40]!r}")
        missing = sorted(writer.required(manifest.world_size) - set(manifest.files))
        if missing:
            raise ManifestError(f"{MANIFEST} does not list {', '.join(missing[:4])} (required to resume)")
    except CheckpointError as e:
        raise type(e)(f"{path.name}: {e}") from None
    return manifest


def read_files(path: Path, manifest: Manifest, names: list[str], keep: set[str]) -> dict[str, Any]:
    """Read and verify the listed files `names` of a checked manifest; the decoded contents of those in keep.

    One thread per file: reads, hashes and torch's copies release the GIL, so the files overlap.
    CheckpointError naming the folder and the first bad file in name order (not in timing order).
    """
    writer = format_named(manifest.writer)
    assert writer is not None  # checked_manifest refused an unknown writer
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(names), _MAX_THREADS)) as pool:
        futures = {
            n: pool.submit(_read_file, path, n, manifest.files[n], manifest.hash, writer, n in keep) for n in names
        }
        outcomes: dict[str, Any] = {}
        try:
            for n in sorted(names):
                outcomes[n] = futures[n].result()
        except CheckpointError as e:
            raise type(e)(f"{path.name}: {e}") from None
    return {n: outcomes[n] for n in names if n in keep}
