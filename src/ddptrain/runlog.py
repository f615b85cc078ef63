"""Per-rank log files: `run.dir/logs/rank-<r>.log` holds that rank's own messages and errors.

Only rank 0 prints, so a warning or traceback on rank 7 would otherwise be lost in a launcher's
interleaved output. Every rank appends its messages, warnings and any uncaught exception to its
own file, so a failed run can be read afterwards, rank by rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddptrain.errors import UserError

RUN_LOG = logging.getLogger("ddptrain.run")
# Without a handler Python's last-resort handler would echo warnings to stderr a second time:
# the terminal output is Progress's job, this logger only feeds the per-rank files.
RUN_LOG.addHandler(logging.NullHandler())
RUN_LOG.propagate = False
RUN_LOG.setLevel(logging.INFO)


def log_message(text: str) -> None:
    """Log a user-facing message at the level its prefix says ('warning: ...', 'error: ...')."""
    level = logging.INFO
    if text.startswith("warning"):
        level = logging.WARNING
    elif text.startswith("error"):
        level = logging.ERROR
    RUN_LOG.log(level, text)


@contextmanager
def rank_log(run_dir: Path, rank: int, world_size: int, hostname: str) -> Iterator[Path]:
    """Append this rank's messages to run_dir/logs/rank-<rank>.log while the block runs.

    An exception leaving the block is written with its traceback before it propagates.
    """
    path = run_dir / "logs" / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s"))
    RUN_LOG.addHandler(handler)
    RUN_LOG.info("rank %d of %d on %s, pid %d", rank, world_size, hostname, os.getpid())
    try:
        yield path
    except UserError as e:
        RUN_LOG.error("error: %s", e)  # bad input: one line, as on the terminal
        raise
    except KeyboardInterrupt:
        RUN_LOG.error("interrupted (KeyboardInterrupt)")
        raise
    except BaseException as e:
        RUN_LOG.error("error: %s: %s", type(e).__name__, e, exc_info=True)
        raise
    finally:
        RUN_LOG.removeHandler(handler)
        handler.close()
