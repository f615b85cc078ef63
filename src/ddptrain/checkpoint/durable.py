"""Durable, hashed, link-refusing writes: the bytes of a checkpoint file hashed as they stream out."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from ddptrain.checkpoint.manifest import FileEntry
from ddptrain.safe_files import open_new_no_follow


class _HashingWriter:
    """A file wrapper that hashes what passes through: torch.save streams into the file and the
    SHA-256 comes for free, with no second in-memory copy of the state and no re-read."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        try:
            self.f.write(data)
        except OSError as e:
            self.error = e  # torch's zip writer reports only "unexpected pos": keep the real cause
            raise
        self.sha256.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def write_durable(path: Path, obj: Any) -> FileEntry:
    """Write obj (bytes as they are, anything else through torch.save) into a NEW file, fsync it.

    The file must not exist yet, as anything, a symbolic link included: a save never writes
    through a name it did not create.
    """

    def produce(out: IO[bytes]) -> None:
        if isinstance(obj, bytes):
            out.write(obj)
        else:
            torch.save(obj, out)

    return write_stream(path, produce)


def write_stream(path: Path, produce: Callable[[IO[bytes]], None]) -> FileEntry:
    """A NEW file filled by produce(stream), hashed as it streams out and fsynced; its manifest entry."""
    with open_new_no_follow(path) as f:
        writer = _HashingWriter(f)
        try:
            produce(writer)  # type: ignore[arg-type]
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(writer.sha256.hexdigest(), writer.size)
