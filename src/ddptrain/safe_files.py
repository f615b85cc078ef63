"""Opening and writing files in a run folder without following links planted there.

A run folder may be shared (a cluster filesystem) or prepared by someone else: a symlink in it
named like one of our files (a log, metrics.jsonl, a checkpoint's temp folder) must never make us
write through it into whatever it points at. Every file ddptrain writes under run.dir goes
through these helpers, which refuse symlinks (O_NOFOLLOW) instead of following them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Any

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def refuse_symlink(path: Path) -> None:
    """OSError(ELOOP) naming path when it is a symbolic link (a planted one must never be followed)."""
    if path.is_symlink():
        raise OSError(40, "refusing to follow a symbolic link", str(path))


def ensure_dir(path: Path) -> None:
    """mkdir -p, refusing when path (or the part created here) is a symbolic link."""
    refuse_symlink(path)
    path.mkdir(parents=True, exist_ok=True)
    refuse_symlink(path)


def open_append_no_follow(path: Path, **kwargs: Any) -> IO[str]:
    """A text file opened for appending; OSError when path is a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | _NOFOLLOW | os.O_CLOEXEC, 0o644)
    stream: IO[str] = os.fdopen(fd, "a", **kwargs)
    return stream


def open_new_no_follow(path: Path, mode: int = 0o644) -> IO[bytes]:
    """A new binary file (permissions `mode`, less the umask); OSError when anything (a file, a link) has that name."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | os.O_CLOEXEC, mode)
    return os.fdopen(fd, "wb")


def read_regular_file(path: Path, limit: int | None = None, *, follow: bool = False) -> bytes:
    """The bytes of a regular file (at most limit + 1 of them); OSError for a non-file, and for a link
    unless follow. Opened non-blocking, so a FIFO planted under the name is refused, never waited on."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else _NOFOLLOW)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(21, "not a regular file", str(path))
        return f.read() if limit is None else f.read(limit + 1)


def read_bytes_no_follow(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file (at most limit + 1 of them); OSError for a link or a non-file."""
    return read_regular_file(path, limit)


def write_text_replace(path: Path, text: str, mode: int = 0o644) -> None:
    """Write text to a fresh temp file beside path, then rename over path: a link at path is replaced, not followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    with open_new_no_follow(tmp, mode) as f:
        f.write(text.encode())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that the names created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
