"""run.dir/trackers.json: which tracker run this run folder feeds, and how far it got.

One run folder is one run in every tracker, across restarts, requeues and world-size changes:
the first start stores each tracker's run id here, every later start continues that run. Each
tracker also records the highest step it delivered per record kind ("train", "eval", ...), so
that steps an abandoned attempt already sent are not sent again after a resume.

Only rank 0 writes it, atomically (temporary file, then rename), from the training thread at
start and from the trackers' delivery threads afterwards (hence the lock).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from ddptrain.errors import ConfigError

FILE_NAME = "trackers.json"


class TrackerState:
    """The contents of run.dir/trackers.json, shared by the trackers of one process."""

    def __init__(self, run_dir: Path, fresh: bool = False) -> None:
        self.path = run_dir / FILE_NAME
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {} if fresh else _read(self.path)

    @property
    def attempt(self) -> int:
        """1 for the first start of this run folder, then one more per restart."""
        return int(self._data.get("attempts", 0))

    def begin_attempt(self, world_size: int) -> int | None:
        """Count this start and remember its world size; returns the previous attempt's world size."""
        with self._lock:
            previous = self._data.get("world_size")
            self._data["attempts"] = self.attempt + 1
            self._data["world_size"] = world_size
            self._save()
        return int(previous) if previous is not None else None

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{FILE_NAME}.tmp")
        tmp.write_text(json.dumps(self._data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


def _read(path: Path) -> dict[str, Any]:
    if path.is_symlink():
        raise ConfigError(f"{path} is a symbolic link; ddptrain reads nothing in run.dir through a link")
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path} is not readable JSON ({e}); fix or delete it (a new tracker run is then started)"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object; fix or delete it (a new tracker run is then started)")
    return data
