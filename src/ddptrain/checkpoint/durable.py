"""Durable, hashed, link-refusing writes: the bytes of a checkpoint file hashed as they stream out."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

from ddptrain.checkpoint.digests import new_hasher
from ddptrain.checkpoint.manifest import FileEntry
from ddptrain.safe_files import open_new_no_follow


class HashingWriter:
    """A file wrapper that hashes what passes through: torch.save (or DCP) streams into the file and
    the digest comes for free, with no second in-memory copy of the state and no re-read."""

    def __init__(self, f: IO[bytes], algorithm: str) -> None:
        self.f, self.hasher, self.size = f, new_hasher(algorithm), 0
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        """Write all of data to the file, then hash it; the number of bytes written."""
        try:
            self.f.write(data)
        except OSError as e:
            self.error = e  # torch's zip writer reports only "unexpected pos": keep the real cause
            raise
        self.hasher.update(data)
        n = memoryview(data).nbytes  # a memoryview's len() counts items, not bytes
        self.size += n
        return n

    def flush(self) -> None:
        """Flush the file's buffer (DCP and write_stream fsync after this)."""
        self.f.flush()

    def tell(self) -> int:
        """The position: a new file written forwards only (no seek here) is as long as what was written."""
        return self.size

    def fileno(self) -> int:
        """The file's descriptor (DCP fsyncs it)."""
        return self.f.fileno()

    def close(self) -> None:
        """Close the file (DCP closes its streams itself; the file's own context closes it again, harmlessly)."""
        self.f.close()

    def entry(self) -> FileEntry:
        """The manifest entry of what was written."""
        return FileEntry(self.hasher.hexdigest(), self.size)


@contextmanager
def new_hashed_file(path: Path, algorithm: str) -> Iterator[HashingWriter]:
    """A NEW file (never through an existing name or link), every byte written to it hashed with algorithm."""
    with open_new_no_follow(path) as f:
        yield HashingWriter(f, algorithm)


def write_durable(path: Path, obj: Any, algorithm: str) -> FileEntry:
    """Write obj (bytes as they are, anything else through torch.save) into a NEW file, fsync it;
    its entry with the digest of the named algorithm (digests.py).

    The file must not exist yet, as anything, a symbolic link included: a save never writes
    through a name it did not create.
    """

    def produce(out: IO[bytes]) -> None:
        if isinstance(obj, bytes):
            out.write(obj)
        else:
            torch.save(obj, out)

    return write_stream(path, produce, algorithm)


def write_stream(path: Path, produce: Callable[[IO[bytes]], None], algorithm: str) -> FileEntry:
    """A NEW file filled by produce(stream), hashed (algorithm) as it streams out and fsynced; its manifest entry."""
    with new_hashed_file(path, algorithm) as writer:
        try:
            produce(writer)  # type: ignore[arg-type]
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        writer.flush()
        os.fsync(writer.fileno())
    return writer.entry()
