"""CSV: the run's metrics in run.dir/metrics.csv, one row per value, for a spreadsheet or a data frame.

Long format (step, time, series, metric, value), so that one file holds every kind of record with
its own fields; a pivot table (or pandas' pivot) turns it into a column per metric. Rows are
appended across restarts, each written with the record it comes from; an attempt's end is a row
too (series "end", metric the ending, value its step).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO, Any

from ddptrain.config import Config
from ddptrain.observe.endings import is_end_record
from ddptrain.observe.trackers.base import record_points, record_series
from ddptrain.observe.trackers.state import TrackerState
from ddptrain.safe_files import ensure_dir, open_append_no_follow

FILE = "metrics.csv"
HEADER = ("step", "time", "series", "metric", "value")


def build(cfg: Config, state: TrackerState | None) -> CsvSink:
    """The CSV sink of a run (a local file: no tracker state)."""
    return CsvSink(cfg.run_dir / FILE)


class CsvSink:
    """Appends a row per numeric value of each record with a step ("<series>/<field>" as in the trackers)."""

    name = "csv"

    def __init__(self, path: Path) -> None:
        ensure_dir(path.parent)
        # Never through a link planted in the run folder; a file opened for appending stands at its end.
        self._file: IO[str] = open_append_no_follow(path, newline="", encoding="utf-8")
        self._rows = csv.writer(self._file)
        if self._file.seek(0, 2) == 0:
            self._rows.writerow(HEADER)

    def write(self, record: dict[str, Any]) -> None:
        """The record's numbers as rows (records without a step are not rows), flushed with the record."""
        if "step" not in record:
            return
        if is_end_record(record):
            self._rows.writerow(
                (record["step"], record.get("time", ""), "end", record.get("event", ""), record["step"])
            )
        series = record_series(record)
        if series is not None:
            for point in record_points(record, series):
                self._rows.writerow((point.step, point.time, series, point.key.removeprefix(f"{series}/"), point.value))
        self._file.flush()

    def upload(self, folder: Path, kind: str) -> None:
        """The CSV file is the run's own: nothing to upload."""

    def close(self, status: str) -> None:
        """Close the file (every row is already flushed)."""
        self._file.close()
