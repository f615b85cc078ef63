"""run.dir/trackers.json: which tracker run this run folder feeds, and how far it got.

One run folder is one run in every tracker, across restarts, requeues and world-size changes:
the first start stores each tracker's run id here, every later start continues that run. Each
tracker also records the highest step it delivered per record kind ("train", "eval", ...), so
that steps an abandoned attempt already sent are not sent again after a resume.

A tracker run is recorded before anything is sent to it: the start stores a creation key
(`run_key`) before the tracker is called, the tracker tags the run it creates with that key and
stores the run's id the moment it exists; a start that finds a key but no id (the earlier one was
killed between the two) finds its run by the key instead of creating another. `open_attempt`
names an attempt until it ends in Python (any ending but a kill): found at the next start, that
attempt crashed.

Only rank 0 writes it, atomically (a fresh temporary file, never through a link, then rename), from
the training thread at start and from the trackers' delivery threads afterwards (hence the lock).
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

from ddptrain.errors import ConfigError
from ddptrain.run_folder import trackers_file
from ddptrain.safe_files import read_regular_file, write_text_replace


class TrackerState:
    """The contents of run.dir/trackers.json, shared by the trackers of one process."""

    def __init__(self, run_dir: Path, fresh: bool = False) -> None:
        self.path = trackers_file(run_dir)
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {} if fresh else _read(self.path)
        self.crashed_attempt: int | None = None  # set by begin_attempt

    @property
    def attempt(self) -> int:
        """1 for the first start of this run folder, then one more per restart."""
        return int(self._data.get("attempts", 0))

    def begin_attempt(self, world_size: int) -> int | None:
        """Count this start and remember its world size; returns the previous attempt's world size.

        Sets crashed_attempt when the previous attempt never reached end_attempt (it was killed).
        """
        with self._lock:
            previous = self._data.get("world_size")
            unended = self._data.get("open_attempt")
            self.crashed_attempt = int(unended) if unended is not None else None
            self._data["attempts"] = self.attempt + 1
            self._data["open_attempt"] = self._data["attempts"]
            self._data["world_size"] = world_size
            self._save()
        return int(previous) if previous is not None else None

    def end_attempt(self) -> None:
        """This attempt ended without being killed (its end record says how)."""
        with self._lock:
            if self._data.pop("open_attempt", None) is not None:
                self._save()

    def run_key(self, tracker: str) -> tuple[str, bool]:
        """(the key the tracker tags the run it creates with, whether an earlier start stored it); stored now
        when new, so that a run created from here on can always be found again."""
        with self._lock:
            entry = self._data.setdefault(tracker, {})
            if "run_key" in entry:
                return str(entry["run_key"]), True
            entry["run_key"] = uuid.uuid4().hex
            self._save()
            return str(entry["run_key"]), False

    def run_id(self, tracker: str) -> str | None:
        """The tracker's run id stored at the first start, if any."""
        run_id = self._data.get(tracker, {}).get("run_id")
        return str(run_id) if run_id is not None else None

    def set_run_id(self, tracker: str, run_id: str) -> None:
        """Store the tracker's run id (before anything else is sent to that run)."""
        with self._lock:
            self._data.setdefault(tracker, {})["run_id"] = run_id
            self._save()

    def delivered(self, tracker: str) -> dict[str, int]:
        """Highest step delivered per record kind."""
        return dict(self._data.get(tracker, {}).get("delivered", {}))

    def set_delivered(self, tracker: str, delivered: dict[str, int]) -> None:
        """Record the highest step delivered per record kind."""
        with self._lock:
            self._data.setdefault(tracker, {})["delivered"] = dict(delivered)
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)  # run.dir itself may be a link the user made
        write_text_replace(self.path, json.dumps(self._data, indent=1, sort_keys=True))


def _read(path: Path) -> dict[str, Any]:
    if path.is_symlink():
        raise ConfigError(f"{path} is a symbolic link; ddptrain reads nothing in run.dir through a link")
    if not path.exists():
        return {}
    try:
        data = json.loads(read_regular_file(path))  # a FIFO under the name is refused, never waited on
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(
            f"{path} is not readable JSON ({e}); fix or delete it (a new tracker run is then started)"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object; fix or delete it (a new tracker run is then started)")
    return data
