"""Metrics sinks and terminal progress. Only rank 0 writes shared files or prints.

`metrics.jsonl` gets one JSON object per logged step (`"kind": "train"`), per evaluation
(`"kind": "eval"`), and per notable event (`"kind": "event"`: start, resume, checkpoint, ...).
Every record also goes to the sinks of `log.trackers` (observe/trackers/).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, TextIO

from tqdm import tqdm

from ddptrain import streams
from ddptrain.errors import UserError
from ddptrain.observe.runlog import FILE_ONLY
from ddptrain.observe.trackers.base import Sink
from ddptrain.run_folder import metrics_file
from ddptrain.safe_files import open_append_no_follow

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: write them as strings so the file stays parseable everywhere.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Appends records to run.dir/metrics.jsonl and hands each to the sinks (trackers/, rank 0 only)."""

    def __init__(self, run_dir: Path, enabled: bool, sinks: Sequence[Sink] = ()) -> None:
        self.enabled = enabled
        self.path = metrics_file(run_dir)
        self._file: IO[str] | None = None
        self._held: list[dict[str, Any]] | None = None  # hold(): the records kept until accept()
        self.sinks = list(sinks) if enabled else []
        if not enabled:
            return
        # Line-buffered append: a crash loses at most the line being written, and a resumed
        # run continues the same file. A planted link is refused, never followed.
        try:
            run_dir.mkdir(parents=True, exist_ok=True)  # run.dir itself may be a link the user made
            self._file = open_append_no_follow(self.path, buffering=1)
        except OSError as e:
            raise UserError(f"cannot open {self.path}: {e.strerror or e}") from None

    def write(self, kind: str, **fields: Any) -> None:
        """One record into metrics.jsonl, then to every sink (a remote tracker only queues it)."""
        if not self.enabled or self._file is None:
            return
        record = {"kind": kind, "time": round(time.time(), 3), **{k: _clean(v) for k, v in fields.items()}}
        if self._held is not None:
            self._held.append(record)
        else:
            self._emit(record)

    def hold(self) -> None:
        """Keep the records in memory from now on until accept(): a run not yet accepted (an in-place replica group
        before its first quorum admits it) that is refused (exit 2) leaves metrics.jsonl and the trackers as they
        were."""
        self._held = []

    def accept(self) -> None:
        """Write the held records (with their own times), and every record from now on."""
        held, self._held = self._held or [], None
        for record in held:
            self._emit(record)

    def _emit(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:
            # A full or read-only disk: say so once and keep training (the checkpoints report
            # their own failures), instead of failing on every record from here on.
            at = f" at step {record['step']}" if "step" in record else ""
            log.warning("cannot write %s%s (%s); metrics are not recorded from here on", self.path, at, e.strerror or e)
            self._close_file()
            return
        for sink in self.sinks:
            sink.write(record)

    def upload(self, folder: Path, kind: str) -> None:
        """Attach a folder of files (kind "report" or "model") to the trackers' runs."""
        for sink in self.sinks:
            sink.upload(folder, kind)

    def close(self, status: str = "completed") -> None:
        """Close metrics.jsonl, then flush the sinks (each within its bounded wait); status ends their runs."""
        self._close_file()
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(status)

    def _close_file(self) -> None:
        if self._file is None:
            return
        try:
            self._file.close()
        except OSError:
            pass  # the failed line was already reported
        self._file = None


class Progress:
    """A progress bar on a TTY, plain periodic lines otherwise (logs, CI, SLURM output).

    Only the enabled (rank 0) instance draws a bar. Every logged step is also a log record
    (see runlog.py): the console shows it when there is no bar, every rank's file always.
    Other lines go through logging, whose console handler writes around the bar.
    """

    def __init__(self, enabled: bool, total: int, initial: int, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout  # None when fd 1 was closed at start
        self.total = total
        self.bar: tqdm[Any] | None = None
        self._first: tuple[float, int] | None = None  # (time, step) of the first update, for the ETA
        if enabled and self.stream is not None and _isatty(self.stream):
            self.bar = tqdm(total=total, initial=initial, file=self.stream, dynamic_ncols=True, unit="step")

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the mean pace since the first update of this process (None before two updates)."""
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
            return None
        t0, s0 = self._first
        return (now - t0) / (step - s0) * (self.total - step) if step > s0 else None

    def update(self, step: int, fields: dict[str, Any]) -> None:
        """Show a logged step's headline numbers (the bar shows its own rate and ETA)."""
        summary = "  ".join(_format(k, v) for k, v in fields.items())
        eta = self.eta_s(step)
        line = f"step {step:>6}/{self.total}  {summary}" + (f"  eta {_duration(eta)}" if eta is not None else "")
        log.info(line, extra=FILE_ONLY if self.bar is not None else None)
        bar = self.bar
        if bar is None:
            return
        try:
            if eta is None:
                # The first shown step: restart the bar's clock here, so that its rate and ETA count
                # only steps this process trained (not a resume's jump, nor start-up time).
                bar.reset()
                bar.initial = bar.n = bar.last_print_n = step
            bar.update(step - bar.n)
            bar.set_postfix_str(summary, refresh=True)
        except (OSError, ValueError):
            self._drop_bar()

    def close(self) -> None:
        """Finish the bar."""
        if self.bar is None:
            return
        try:
            self.bar.close()
        except (OSError, ValueError):
            self._drop_bar()
        self.bar = None

    def _drop_bar(self) -> None:
        # The terminal went away (a closed pipe, a hung-up terminal): training goes on without a bar,
        # and every step still reaches the rank's log file.
        bar, self.bar = self.bar, None
        if bar is not None:
            bar.disable = True
        streams.silence(self.stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _format(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.2e}"
        if key == "mfu":
            return f"{key} {value:.1%}"
        if key.endswith("_per_s"):
            return f"{key} {value:,.1f}" if value < 100 else f"{key} {value:,.0f}"
        return f"{key} {value:.4f}" if abs(value) < 100 else f"{key} {value:,.0f}"
    return f"{key} {value}"
