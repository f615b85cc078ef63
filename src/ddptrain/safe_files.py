"""Opening and writing files in a run folder without following links planted there.

A run folder may be shared (a cluster filesystem) or prepared by someone else: a symlink in it
named like one of our files (a log, metrics.jsonl, a checkpoint's temp folder) must never make us
write through it into whatever it points at. Every file ddptrain writes under run.dir goes
through these helpers, which refuse symlinks (O_NOFOLLOW) instead of following them.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NOT_REGULAR = errno.EISDIR  # the errno of "not a regular file": bad input where cli.main maps OS errors


def not_regular(path: Path) -> OSError:
    """The error for a FIFO, socket, device or folder where a regular file belongs."""
    return OSError(_NOT_REGULAR, "not a regular file", str(path))


def refuse_symlink(path: Path) -> None:
    """OSError(ELOOP) naming path when it is a symbolic link (a planted one must never be followed)."""
    if path.is_symlink():
        raise OSError(errno.ELOOP, "refusing to follow a symbolic link", str(path))


def ensure_dir(path: Path, root: Path | None = None) -> None:
    """mkdir -p of path below root (default: its parent), refusing a symbolic link or a non-folder at path or
    at any folder between root and path. root itself may be a link: run.dir may be one the user made."""
    root = path.parent if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        try:
            os.mkdir(current)
        except FileExistsError:
            pass
        mode = os.lstat(current).st_mode
        if stat.S_ISLNK(mode):
            raise OSError(errno.ELOOP, "refusing to follow a symbolic link", str(current))
        if not stat.S_ISDIR(mode):
            raise OSError(errno.ENOTDIR, "not a folder", str(current))


def open_regular(path: Path, flags: int, *, follow: bool = False) -> int:
    """A descriptor of the regular file at path (os.open flags); OSError for a link (unless follow) or a non-file.

    Opened non-blocking, so a FIFO planted under the name is refused, never waited on (a FIFO opened
    for writing with no reader fails with ENXIO, one with a reader is caught by fstat); the returned
    descriptor is blocking again, as a regular file's reads and writes expect.
    """
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else _NOFOLLOW)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise not_regular(path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_regular(path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular_or_absent(path: Path) -> None:
    """OSError unless path is missing or a regular file (not a link): a look without opening, for a file
    written later in the run, so that a planted link or FIFO is refused at start."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, "refusing to follow a symbolic link", str(path))
    if not stat.S_ISREG(mode):
        raise not_regular(path)


def open_append_no_follow(path: Path, **kwargs: Any) -> IO[str]:
    """A regular text file opened for appending; OSError when path is a symbolic link or not a regular file."""
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    stream: IO[str] = os.fdopen(fd, "a", **kwargs)
    return stream


def open_new_no_follow(path: Path, mode: int = 0o644) -> IO[bytes]:
    """A new binary file (permissions `mode`, less the umask); OSError when anything (a file, a link) has that name."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | os.O_CLOEXEC, mode)
    return os.fdopen(fd, "wb")


def read_regular_file(path: Path, limit: int | None = None, *, follow: bool = False) -> bytes:
    """The bytes of a regular file (at most limit + 1 of them); OSError for a non-file, and for a link
    unless follow. Opened non-blocking, so a FIFO planted under the name is refused, never waited on."""
    with os.fdopen(open_regular(path, os.O_RDONLY, follow=follow), "rb") as f:
        return f.read() if limit is None else f.read(limit + 1)


def read_bytes_no_follow(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file (at most limit + 1 of them); OSError for a link or a non-file."""
    return read_regular_file(path, limit)


@contextmanager
def replacing(path: Path, mode: int = 0o644) -> Iterator[IO[bytes]]:
    """A fresh temp file beside path, created no-follow, renamed over path when the block succeeds (removed
    when it fails): whatever had the name (a planted link, a FIFO) is replaced, never followed or opened."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a killed writer, or a link planted under the temp name
    try:
        with open_new_no_follow(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes_replace(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write data to a fresh temp file beside path, then rename over path: a link at path is replaced, not followed."""
    with replacing(path, mode) as f:
        f.write(data)


def write_text_replace(path: Path, text: str, mode: int = 0o644) -> None:
    """Write text to a fresh temp file beside path, then rename over path: a link at path is replaced, not followed."""
    write_bytes_replace(path, text.encode(), mode)


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that the names created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
