"""Logging: module loggers under "ddptrain", rank 0's console and every rank's own log file.

Code logs through `logging.getLogger(__name__)` at the level it means (info, warning, error).
While a run is set up (`run_logging`), two handlers hang on the "ddptrain" logger:

* rank 0's console: progress lines on stdout, warnings and errors ("warning: ...", "error: ...")
  on stderr, where a failed command's reason belongs (a run that exits 1 says why there); all
  written through tqdm so that they never break the progress bar;
* every rank's file `run.dir/logs/rank-<r>.log`: the same records with time, rank and level, and
  any uncaught exception with its traceback. Only rank 0 prints, so a warning on rank 7 would
  otherwise be lost in a launcher's interleaved output.

A handler that cannot write (a full or read-only disk, a console whose reader went away) says so
in one line on stderr (if it can) and stops writing, instead of printing a traceback for every
record that follows; training goes on.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from ddptrain import streams
from ddptrain.errors import Interrupted, Preempted, UserError
from ddptrain.run_folder import rank_log
from ddptrain.safe_files import ensure_dir, open_append_no_follow

PACKAGE_LOG = logging.getLogger("ddptrain")
PACKAGE_LOG.setLevel(logging.INFO)
# The run's own handlers decide where records go: no echo through the root logger's handlers, nor
# Python's last-resort handler when no run is set up.
PACKAGE_LOG.addHandler(logging.NullHandler())
PACKAGE_LOG.propagate = False
log = logging.getLogger(__name__)

# logger.info(..., extra=FILE_ONLY): a record the console already shows another way (the bar).
FILE_ONLY = {"console": False}
_PREFIX = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}


class _OneComplaint:
    """Mixin: the first failed write prints one line to stderr and disables the handler."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        err = sys.exc_info()[1]
        what = getattr(self, "baseFilename", None) or "the console"
        if not getattr(self, "_gave_up", False):
            self._gave_up = True
            reason = getattr(err, "strerror", None) or err
            streams.say(f"warning: cannot write the log to {what} ({reason}); logging there stops")
        self.setLevel(logging.CRITICAL + 1)  # type: ignore[attr-defined]


class ConsoleHandler(_OneComplaint, logging.Handler):
    """Rank 0's terminal: one plain line per record, through tqdm.write (safe beside a progress bar).

    stream: where every record goes; None: info to stdout, warnings and errors to stderr.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(logging.INFO)
        self.stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "console", True) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        stream = self.stream or (sys.stderr if record.levelno >= logging.WARNING else sys.stdout)
        try:
            text = _PREFIX.get(record.levelno, "") + record.getMessage()
            tqdm.write(text, file=stream)
            stream.flush()
        except Exception as e:
            if isinstance(e, (OSError, ValueError)):
                # The reader went away (`| tee` ended by Ctrl-C) or the disk is full: training goes on, the
                # rank's file keeps every line, and the interpreter's last flush must not fail on this stream.
                streams.silence(stream)
            self.handleError(record)


class RankFileHandler(_OneComplaint, logging.StreamHandler):  # type: ignore[type-arg]
    """This rank's log file, opened for appending without following a link.

    hold: keep the records in memory until accept() (a run not yet accepted, whose refusal must
    leave the file as it was); discard() drops them.
    """

    def __init__(self, path: Path, hold: bool = False) -> None:
        super().__init__(open_append_no_follow(path, encoding="utf-8"))
        self.baseFilename = str(path)
        self._held: list[logging.LogRecord] = []
        self._state = "hold" if hold else "write"  # -> "write" (accept) or "drop" (discard)

    def emit(self, record: logging.LogRecord) -> None:
        if self._state == "write":
            super().emit(record)
        elif self._state == "hold":
            self._held.append(record)

    def accept(self) -> None:
        """Write the held records, and every record from now on, to the file (unless discarded)."""
        if self._state == "hold":
            self._state = "write"
            for record in self._held:
                self.handle(record)
            self._held.clear()

    def discard(self) -> None:
        """A refused run: drop the held records and every later one; the file stays as it was."""
        if self._state == "hold":
            self.stop()

    def stop(self) -> None:
        """Nothing more reaches the file, held or not (the run folder became another run's)."""
        self._state = "drop"
        self._held.clear()

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            super().close()


def stop_rank_files() -> None:
    """This process's rank log files get nothing more (another run took the run folder's lease)."""
    for handler in list(PACKAGE_LOG.handlers):
        if isinstance(handler, RankFileHandler):
            handler.stop()


@contextmanager
def run_logging(
    run_dir: Path, rank: int, world_size: int, hostname: str, console: bool | None = None, hold: bool = False
) -> Iterator[RankFileHandler]:
    """While the block runs: this rank's records go to run_dir/logs/rank-<rank>.log, rank 0's to stdout.

    console: show records on stdout (default: rank 0 only). An exception leaving the block is
    logged to the file (with its traceback unless it is bad input or a requested stop).
    hold: the file gets nothing until the yielded handler's accept(); bad input (UserError) leaving
    the block before that drops the held records, so a refused run leaves the file as it was
    (its one line is on stderr); any other exception writes them, for the post-mortem.
    """
    path = rank_log(run_dir, rank)
    try:
        ensure_dir(path.parent)
        file_handler = RankFileHandler(path, hold)  # a planted link is refused, never followed
    except OSError as e:
        raise UserError(f"cannot write the run's log {path}: {e.strerror or e}") from None
    file_handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    handlers: list[logging.Handler] = [file_handler]
    if console if console is not None else rank == 0:
        handlers.append(ConsoleHandler())
    for h in handlers:
        PACKAGE_LOG.addHandler(h)
    log.info("rank %d of %d on %s, pid %d", rank, world_size, hostname, os.getpid(), extra=FILE_ONLY)
    try:
        yield file_handler
    except UserError as e:
        file_handler.discard()
        log.error("%s", e, extra=FILE_ONLY)  # bad input: one line, as the command prints it
        raise
    except (Preempted, Interrupted) as e:
        log.info("%s", e, extra=FILE_ONLY)
        raise
    except KeyboardInterrupt:
        log.error("interrupted (KeyboardInterrupt)", extra=FILE_ONLY)
        raise
    except BaseException as e:
        log.error("%s: %s", type(e).__name__, e, exc_info=True, extra=FILE_ONLY)
        raise
    finally:
        file_handler.accept()  # a failure other than bad input still leaves its lines (no-op once accepted)
        for h in handlers:
            PACKAGE_LOG.removeHandler(h)
            try:
                h.close()
            except OSError:
                pass  # a full disk: already said once; must not replace the error that is leaving
