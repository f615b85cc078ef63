"""Reading a checkpoint file once while hashing it: the reader verification hands to a format's decode().

Every byte a format decodes passes through the hasher on its way (verify.py compares the digest
with the manifest's once the file is read), so verification and decoding are one read. bytes_read() counts what every reader of this process
took from storage (how a shared load's 1/W per rank is measured: bench/checkpoint_ranks.py, tests).
"""

from __future__ import annotations

import threading
from typing import IO

from ddptrain.checkpoint.digests import new_hasher

_CHUNK = 4 << 20
_count_lock = threading.Lock()  # files are read on several threads at once
_count = [0]


def bytes_read() -> int:
    """Bytes this process has read from checkpoint files so far (every HashingReader's, since it started)."""
    return _count[0]


def _counted(n: int) -> int:
    with _count_lock:
        _count[0] += n
    return n


class HashingReader:
    """A file of known size read forwards once; every byte read is hashed on the way (the GIL is
    released for big buffers, so files hashed in parallel threads overlap)."""

    def __init__(self, f: IO[bytes], size: int, algorithm: str) -> None:
        self._f, self.left, self._hasher = f, size, new_hasher(algorithm)

    def read(self, n: int) -> bytes:
        """Up to n bytes (fewer only at the end of the file)."""
        data = self._f.read(max(0, min(n, self.left)))
        self._hasher.update(data)
        self.left -= _counted(len(data))
        return data

    def read_all(self) -> bytes:
        """Every byte not read yet, as one bytes object."""
        chunks = []
        while self.left > 0:
            data = self.read(self.left)  # one read for a regular file; short reads loop
            if not data:
                break
            chunks.append(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def readinto(self, buf: memoryview) -> None:
        """Fill buf completely; EOFError when the file ends first."""
        if len(buf) > self.left:
            raise EOFError("the file ends early")
        done = 0
        while done < len(buf):
            got = self._f.readinto(buf[done:])  # type: ignore[attr-defined]
            if not got:
                raise EOFError("the file ends early")
            done += _counted(got)
        self._hasher.update(buf)
        self.left -= len(buf)

    def finish(self) -> tuple[int, str]:
        """Hash what was not read yet; (bytes hashed beyond the expected size, hex digest)."""
        while self.left > 0:
            if not self.read(_CHUNK):
                break
        extra = _counted(len(self._f.read(1)))
        return extra - self.left, self._hasher.hexdigest()
