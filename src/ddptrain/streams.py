"""Writing to stdout and stderr without ever failing because of them.

`ddptrain train ... 2>&1 | tee log`, then Ctrl-C: the terminal's SIGINT ends tee too, and every
later write to the pipe fails (EPIPE: Python ignores SIGPIPE, so a write raises BrokenPipeError).
A closed descriptor, a full disk under `> log` and a terminal that went away (EIO) fail alike.
Training, the coordinated stop and the exit code must not depend on whoever reads the output:
the run's own files (run.dir/logs, metrics.jsonl) keep everything.

A stream found broken is pointed at /dev/null (dup2 onto its file descriptor): what is still in
its buffer and everything written later vanish instead of failing. Otherwise the interpreter's
last flush at exit fails too, and Python then exits 120 whatever the program returned.
"""

from __future__ import annotations

import io
import os
import select
import sys
from typing import TextIO

STD_FDS = (0, 1, 2)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _null_onto(fd: int) -> None:
    """Make fd refer to /dev/null."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    try:
        if null != fd:
            os.dup2(null, fd)
    finally:
        if null != fd:
            os.close(null)


def ensure_standard_streams() -> None:
    """At program start: a closed fd 0, 1 or 2 becomes /dev/null, and sys.stdout/sys.stderr exist.

    With fd 1 closed (`cmd >&-`) the next file opened would get descriptor 1, and anything written
    to "stdout" (by a library, or a child process inheriting it) would land in that file.
    """
    for fd in STD_FDS:
        if not _is_open(fd):
            _null_onto(fd)
    if sys.stdout is None:
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    if sys.stderr is None:
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)


def silence(stream: TextIO | None) -> None:
    """Point a broken stream's descriptor at /dev/null and drop what its buffer still holds."""
    if stream is None:
        return
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return  # closed, or not backed by a descriptor: nothing will flush it at exit either
    _null_onto(fd)
    try:
        stream.flush()  # the failed write's bytes, now into /dev/null
    except (OSError, ValueError):
        pass


def write(stream: TextIO | None, text: str) -> bool:
    """Write and flush text; False, with the stream silenced, when it cannot be written."""
    if stream is None:
        return False
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # EPIPE, EIO, ENOSPC, EBADF; ValueError: the file object is closed
        silence(stream)
        return False
    return True


def say(text: str) -> None:
    """One line on stderr, in one write (lines of ranks sharing a pipe must not interleave mid-line); never fails,
    so it serves as the `say` callback of the commands (warnings of the checkpoint search, the prepare lock)."""
    write(sys.stderr, text if text.endswith("\n") else text + "\n")


def write_fd(fd: int, data: bytes) -> None:
    """os.write for signal handlers (no stream lock taken); a failed write is ignored."""
    try:
        os.write(fd, data)
    except OSError:
        pass


def _pipe_reader_gone(fd: int) -> bool:
    """Whether fd is a pipe (or socket) whose reading end is closed: poll reports an error on it."""
    if not hasattr(select, "poll"):
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        events = poller.poll(0)
    except (OSError, ValueError):
        return False
    return any(mask & (select.POLLERR | select.POLLNVAL) for _, mask in events)


def flush_standard_streams() -> None:
    """At exit: flush stdout and stderr; one whose reader is gone is silenced first, so exit keeps its code."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            broken = _pipe_reader_gone(stream.fileno())
        except (OSError, ValueError, AttributeError):
            broken = False
        if broken:
            silence(stream)
        else:
            write(stream, "")
