"""Reading a checkpoint file once while hashing it: the reader verification hands to a format's decode().

Every byte a format decodes passes through the hasher on its way (verify.py compares the digest
with the manifest's once the file is read), so verification and decoding are one read.
"""

from __future__ import annotations

from typing import IO

from ddptrain.checkpoint.digests import new_hasher

_CHUNK = 4 << 20


class HashingReader:
    """A file of known size read forwards once; every byte read is hashed on the way (the GIL is
    released for big buffers, so files hashed in parallel threads overlap)."""

    def __init__(self, f: IO[bytes], size: int, algorithm: str) -> None:
        self._f, self.left, self._hasher = f, size, new_hasher(algorithm)

    def read(self, n: int) -> bytes:
        """Up to n bytes (fewer only at the end of the file)."""
        data = self._f.read(max(0, min(n, self.left)))
        self._hasher.update(data)
        self.left -= len(data)
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
            done += got
        self._hasher.update(buf)
        self.left -= len(buf)

    def finish(self) -> tuple[int, str]:
        """Hash what was not read yet; (bytes hashed beyond the expected size, hex digest)."""
        while self.left > 0:
            if not self.read(_CHUNK):
                break
        extra = len(self._f.read(1))
        return extra - self.left, self._hasher.hexdigest()
