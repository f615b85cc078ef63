"""The checksums a checkpoint's files can be recorded with, by the name its manifest gives.

BLAKE3 is the default (docs/checkpoints.md "Which checksum"): cryptographic like SHA-256, so a
recorded digest still names the content even against a file crafted to collide, and several
times faster, so hashing keeps up with the disk. SHA-256 stays selectable (ckpt.hash=sha256, e.g.
where a compliance rule names it) and is what every manifest written before the algorithm was
recorded used. Both digests are 32 bytes, 64 lowercase hex characters.
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

import blake3

DEFAULT_HASH = "blake3"
# A manifest without a `hash` field (format 2, before the algorithm was recorded) used SHA-256.
LEGACY_HASH = "sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class Hasher(Protocol):
    """What hashlib's and blake3's hashers have in common: update, then hexdigest."""

    def update(self, data: bytes | memoryview, /) -> object:
        """Feed bytes (a big buffer is hashed without the GIL by both libraries)."""
        ...

    def hexdigest(self) -> str:
        """The digest of everything fed so far, as lowercase hex."""
        ...


def _blake3() -> Hasher:
    # AUTO: a big buffer (a tensor read into memory, a record torch.save writes) is hashed on
    # several cores; small updates stay on the calling thread (the library decides per call).
    hasher: Hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    return hasher


_FACTORIES = {"blake3": _blake3, "sha256": hashlib.sha256}
HASHES = tuple(sorted(_FACTORIES))
SHOWN = {"blake3": "BLAKE3", "sha256": "SHA-256"}  # how messages name each algorithm


def new_hasher(name: str) -> Hasher:
    """A fresh hasher of the named algorithm; ValueError for a name not in HASHES."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown hash algorithm {name[:40]!r} (known: {', '.join(HASHES)})")
    return factory()


def is_digest(name: str, value: object) -> bool:
    """True when value has the form of a hex digest of the named algorithm."""
    return name in _FACTORIES and isinstance(value, str) and _HEX64.fullmatch(value) is not None
