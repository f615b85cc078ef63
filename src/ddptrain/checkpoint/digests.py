"""The checksums a checkpoint's files can be recorded with, by the name its manifest gives (config/kinds.py's
HASHES registers each: its name, its hasher and how messages name it).

BLAKE3 is the default (docs/checkpoints.md "Which checksum"): cryptographic like SHA-256, so a
recorded digest still names the content even against a file crafted to collide, and several
times faster, so hashing keeps up with the disk. SHA-256 stays selectable (ckpt.hash=sha256, e.g.
where a compliance rule names it) and is what every manifest written before the algorithm was
recorded used. Both digests are 32 bytes, 64 lowercase hex characters.
"""

from __future__ import annotations

import re
from typing import Protocol

import blake3

from ddptrain.config.kinds import DEFAULT_HASH
from ddptrain.config.kinds import HASHES as _REGISTRY

__all__ = ["DEFAULT_HASH", "HASHES", "LEGACY_HASH", "SHOWN", "Hasher", "blake3_hasher", "is_digest", "new_hasher"]

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


def blake3_hasher() -> Hasher:
    """A fresh BLAKE3 hasher."""
    # AUTO: a big buffer (a tensor read into memory, a record torch.save writes) is hashed on
    # several cores; small updates stay on the calling thread (the library decides per call).
    hasher: Hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    return hasher


HASHES = tuple(sorted(_REGISTRY))
SHOWN = {name: kind.shown for name, kind in _REGISTRY.items()}  # how messages name each algorithm


def new_hasher(name: str) -> Hasher:
    """A fresh hasher of the named algorithm; ValueError for a name not in HASHES."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown hash algorithm {name[:40]!r} (known: {', '.join(HASHES)})")
    hasher: Hasher = _REGISTRY.load(name)()
    return hasher


def is_digest(name: str, value: object) -> bool:
    """True when value has the form of a hex digest of the named algorithm."""
    return name in _REGISTRY and isinstance(value, str) and _HEX64.fullmatch(value) is not None
