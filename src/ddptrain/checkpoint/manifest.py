"""The manifest: what a checkpoint holds, its own checksum, and the rules its names must follow.

A manifest is JSON in UTF-8 (format 3):

    format, step, world_size, timeline, writer, created, hash, files {name: {digest, size}},
    config (the resolved config), identity {data, model}, checksum

`hash` names the algorithm of every file's `digest` (digests.py: blake3 or sha256). Format 2,
written before the algorithm was recorded, has no `hash` and files {name: {sha256, size}}: it is
still read, as SHA-256, and verifies exactly as before.

`checksum` is the SHA-256 of the canonical JSON of every other field, whatever `hash` says (one
fixed rule, checked before any other field is trusted; a manifest is kilobytes, so its speed does
not matter): one flipped digit anywhere (a world size, a step, a file's digest) makes the
manifest, and so the checkpoint, rejected. Every field is type-checked on reading; anything
malformed is a ManifestError, never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ddptrain.checkpoint.digests import HASHES, LEGACY_HASH, is_digest
from ddptrain.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = 3
LEGACY_FORMAT = 2  # SHA-256 under each file's `sha256`, no `hash` field: still read
PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
MAX_MANIFEST_BYTES = 64 << 20  # far above any real manifest (its config takes at most 8 MiB: config_io.py)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
# Files whose names on disk are not plain (DCP's commit marker is a hidden file): the manifest
# lists them under a plain name, and only these exact names are mapped.
DCP_METADATA = "dcp.metadata"
_ON_DISK = {DCP_METADATA: ".metadata"}


class ManifestError(CheckpointError):
    """A manifest that is missing, unreadable or malformed: its checkpoint is rejected."""


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after `step` optimizer steps."""
    return f"{PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a committed checkpoint folder's name, None for any other name."""
    digits = name[len(PREFIX) :]
    if name.startswith(PREFIX) and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


def is_plain_name(name: object) -> bool:
    """True for a plain file name inside a checkpoint folder: no separators, no '..', no hidden names."""
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None and ".." not in name


def disk_name(name: str) -> str:
    """The file a manifest entry names on disk: the entry itself, or one of the fixed mapped names."""
    return _ON_DISK.get(name, name)


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_checksum(fields: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of every field but `checksum`."""
    return hashlib.sha256(_canonical({k: v for k, v in fields.items() if k != "checksum"})).hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as its writer recorded it."""

    digest: str  # hex, of the algorithm its manifest's `hash` names
    size: int


@dataclass(frozen=True)
class Manifest:
    """A parsed, checksummed, type-checked manifest."""

    step: int
    world_size: int
    timeline: str
    writer: str
    created: float
    files: dict[str, FileEntry]
    config: dict[str, Any]
    identity: dict[str, Any]
    hash: str = LEGACY_HASH  # the algorithm of every file's digest; unnamed (format 2) means SHA-256

    def to_bytes(self) -> bytes:
        """The manifest as written to disk (always the current format), checksum included."""
        if self.hash not in HASHES:
            raise ManifestError(f"{MANIFEST} would name an unknown hash algorithm {self.hash[:40]!r}")
        fields: dict[str, Any] = {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "timeline": self.timeline,
            "writer": self.writer,
            "created": self.created,
            "hash": self.hash,
            "files": {n: {"digest": e.digest, "size": e.size} for n, e in sorted(self.files.items())},
            "config": self.config,
            "identity": self.identity,
        }
        fields["checksum"] = manifest_checksum(fields)
        data = json.dumps(fields, indent=1, ensure_ascii=True, allow_nan=False).encode()
        if len(data) > MAX_MANIFEST_BYTES:  # the reader's limit: never commit what cannot be read back
            raise ManifestError(f"{MANIFEST} would take {len(data):,} bytes, more than {MAX_MANIFEST_BYTES:,}")
        return data


def _field(fields: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in fields:
        raise ManifestError(f"{MANIFEST} has no '{key}'")
    value = fields[key]
    # bool is an int to Python: a manifest saying "step": true is malformed, not step 1.
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ManifestError(f"{MANIFEST}: '{key}' is a {type(value).__name__}, not a {getattr(kind, '__name__', kind)}")
    return value


def _entry(name: Any, raw: Any, algorithm: str, key: str) -> tuple[str, FileEntry]:
    if not is_plain_name(name):
        # Never touch, stat or echo more than a short, escaped prefix of such a name.
        raise ManifestError(
            f"{MANIFEST} lists {str(name)[:40]!r}, which is not a plain file name in the checkpoint folder"
        )
    if not isinstance(raw, dict) or set(raw) != {key, "size"}:
        raise ManifestError(f"{MANIFEST}: the entry of {name} is not {{{key}, size}}")
    digest, size = raw[key], raw["size"]
    if not is_digest(algorithm, digest) or isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ManifestError(f"{MANIFEST}: the entry of {name} has a malformed {key} or size")
    return name, FileEntry(digest, size)


def _algorithm(fields: dict[str, Any], fmt: int) -> tuple[str, str]:
    """(algorithm, the entries' digest key): format 2 is SHA-256 under `sha256`; format 3 names it in `hash`."""
    if fmt == LEGACY_FORMAT:
        return LEGACY_HASH, "sha256"
    algorithm = _field(fields, "hash", str)
    if algorithm not in HASHES:
        raise ManifestError(
            f"{MANIFEST} names an unknown hash algorithm {algorithm[:40]!r} (this ddptrain knows {', '.join(HASHES)})"
        )
    return algorithm, "digest"


def parse_manifest(data: bytes) -> Manifest:
    """A Manifest from the bytes of manifest.json; ManifestError naming the first thing wrong."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        fields = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ManifestError(f"{MANIFEST} is not valid UTF-8") from None
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{MANIFEST} is not valid JSON ({str(e)[:80]})") from None
    if not isinstance(fields, dict):
        raise ManifestError(f"{MANIFEST} is not a JSON object")
    fmt = _field(fields, "format", int)
    if fmt not in (LEGACY_FORMAT, FORMAT):
        raise ManifestError(
            f"{MANIFEST} has format {fmt}; this ddptrain reads formats {LEGACY_FORMAT} and {FORMAT} (checksummed manifests)"
        )
    checksum = _field(fields, "checksum", str)
    try:
        expected = manifest_checksum(fields)
    except (ValueError, TypeError):
        raise ManifestError(f"{MANIFEST} holds values that have no canonical JSON form") from None
    if checksum != expected:
        raise ManifestError(f"{MANIFEST} does not match its own checksum (edited or corrupted)")
    step, world_size = _field(fields, "step", int), _field(fields, "world_size", int)
    if step < 0 or world_size < 1:
        raise ManifestError(f"{MANIFEST}: step {step} or world size {world_size} is out of range")
    created = _field(fields, "created", (int, float))
    if not math.isfinite(created):
        raise ManifestError(f"{MANIFEST}: 'created' is not a finite number")
    algorithm, key = _algorithm(fields, fmt)
    files = dict(_entry(n, e, algorithm, key) for n, e in _field(fields, "files", dict).items())
    return Manifest(
        step,
        world_size,
        _field(fields, "timeline", str),
        _field(fields, "writer", str),
        float(created),
        files,
        _field(fields, "config", dict),
        _field(fields, "identity", dict),
        algorithm,
    )


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
