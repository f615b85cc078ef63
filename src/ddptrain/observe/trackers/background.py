"""Delivery off the training thread: a bounded queue and one thread per tracker.

The training thread only puts records into a queue (never waits: a full queue drops its oldest
record and counts it). The thread turns records into tracker calls, skips steps the tracker already holds
(an abandoned attempt sent them before the resume), first sends what earlier attempts logged to
metrics.jsonl but a kill kept from the tracker, and retries a failing call with backoff while
records keep queueing: a tracker that is slow or down costs at most `capacity` queued records of
memory, one warning when it fails and one line when it is back. `close` waits a bounded time for
the queue to drain and says what was not delivered; it never raises and never changes the exit code.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddptrain.observe.trackers.base import StartInfo, Tracker, Update, lifecycle_tags, record_points, record_series
from ddptrain.observe.trackers.state import TrackerState
from ddptrain.safe_files import read_regular_file

BATCH = 200  # records per delivery at most (MLflow takes 1,000 metrics per call; ddptrain chunks anyway)
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 30.0


class Backlog:
    """The records earlier attempts wrote to metrics.jsonl (its first n_bytes, measured before this one wrote)."""

    def __init__(self, path: Path, n_bytes: int) -> None:
        self.path, self.n_bytes = path, n_bytes

    def records(self, up_to_step: int) -> list[dict[str, Any]]:
        """Metric records (not lifecycle events) at steps <= up_to_step, in file order; a torn line is skipped."""
        if self.n_bytes <= 0:
            return []
        try:  # the file this run appends to (opened no-follow, a regular file): read it the same way
            lines = read_regular_file(self.path, self.n_bytes)[: self.n_bytes].splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # the line a crash cut off
            if isinstance(record, dict) and record_series(record) and int(record.get("step", -1)) <= up_to_step:
                out.append(record)
        return out


class _Closed(Exception):
    """The flush deadline passed while a call kept failing."""


class BackgroundTracker:
    """A metrics sink that feeds one Tracker from its own thread (rank 0 only)."""

    def __init__(
        self,
        tracker: Tracker,
        state: TrackerState,
        start: StartInfo,
        previous_world_size: int | None,
        say: Callable[[str], None],
        capacity: int,
        flush_s: float,
        backlog: Backlog | None = None,
    ) -> None:
        self.tracker, self.state, self.start = tracker, state, start
        self.previous_world_size = previous_world_size
        self.say = say
        self.flush_s = flush_s
        self.name = tracker.name
        self.capacity = capacity
        self._queue: deque[tuple[str, Any]] = deque()
        self._ready = threading.Condition()
        self._closing = threading.Event()
        self._wake = threading.Event()  # cuts a retry's sleep short when close() sets the deadline
        self._deadline = float("inf")
        self._status = "failed"
        self.dropped = 0  # records not queued because the queue was full
        self.skipped = 0  # records at steps the tracker already held (sent by an earlier attempt)
        self._down_since: float | None = None
        self._reported_dropped = 0  # drops already named in a message
        self._last_error = ""
        self._delivered: dict[str, int] = {}
        self._backlog = backlog
        self._in_flight = 0  # records taken from the queue and not yet delivered
        self._thread = threading.Thread(target=self._run, name=f"ddptrain-{self.name}", daemon=True)
        self._thread.start()

    # ---- the training thread's side ------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        """Queue one metrics record; never blocks (a full queue drops its oldest record and counts it)."""
        self._put(("record", record))

    def upload(self, folder: Path, kind: str) -> None:
        """Queue a folder to attach to the run at the end (the report, the exported model)."""
        self._put(("upload", (folder, kind)))

    def _put(self, item: tuple[str, Any]) -> None:
        with self._ready:
            if len(self._queue) >= self.capacity:
                # Drop the oldest: after an outage the newest records (where training is now) matter most.
                self._queue.popleft()
                self.dropped += 1
                warn = self.dropped == 1 and self._down_since is None
            else:
                warn = False
            self._queue.append(item)
            self._ready.notify()
        if warn:
            self.say(
                f"warning: {self.name}: {self.capacity} records wait for delivery; dropping the oldest until "
                f"it catches up (training is not slowed)"
            )

    def _take(self, limit: int) -> list[tuple[str, Any]]:
        """Up to limit queued items (records, or one upload), waiting 0.2 s at most for the first."""
        with self._ready:
            if not self._queue:
                self._ready.wait(0.2)
            batch: list[tuple[str, Any]] = []
            while self._queue and len(batch) < limit and (not batch or batch[-1][0] == "record"):
                batch.append(self._queue.popleft())
            return batch

    def pending(self) -> int:
        """Records queued or being delivered right now."""
        return len(self._queue) + self._in_flight

    def close(self, status: str) -> None:
        """Deliver what is queued, mark the run `status`; wait at most flush_s, then report what is left."""
        timeout_s = self.flush_s
        self._status = status
        self.state.end_attempt()  # this attempt ended in Python: the next start will not call it a crash
        self._deadline = time.monotonic() + timeout_s
        self._closing.set()
        self._wake.set()
        with self._ready:
            self._ready.notify()
        self._thread.join(timeout_s + 1.0)
        left = self.pending()
        if self.skipped:
            self.say(
                f"{self.name}: {self.skipped} record(s) at steps the run already had from an earlier attempt "
                f"were not sent again"
            )
        if self._thread.is_alive() or left:
            self.say(
                f"warning: {self.name}: gave up after log.tracker_flush_s={timeout_s:g}s: {left} record(s) not "
                f"delivered, {self.dropped} dropped earlier ({self._reason()}); the run itself is unaffected "
                f"and metrics.jsonl has every record"
            )
        elif self.dropped > self._reported_dropped:
            self.say(
                f"warning: {self.name}: {self.dropped - self._reported_dropped} record(s) were dropped while "
                f"it was slow (metrics.jsonl has every record)"
            )

    # ---- the delivery thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._retrying(self._open)
            while True:
                closing = self._closing.is_set()  # read before taking: nothing queued before close is missed
                batch = self._take(BATCH)
                if batch:
                    self._in_flight = len(batch)
                    self._deliver(batch)
                    self._in_flight = 0
                elif closing:
                    break
            final = Update(tags={"ddptrain.status": self._status}, delivered=dict(self._delivered))
            self._retrying(lambda: self.tracker.send(final))
            self._retrying(lambda: self.tracker.finish(self._status))
        except _Closed:
            pass
        except Exception as e:  # a bug in a tracker must not end the process: say it once, stop tracking
            self.say(f"warning: {self.name}: tracking stopped: {type(e).__name__}: {e}")

    def _open(self) -> None:
        opened = self.tracker.open(self.state.run_id(self.name), self.start)
        if opened.run_id != self.state.run_id(self.name):
            self.state.set_run_id(self.name, opened.run_id)
        for note in opened.notes:
            self.say(f"warning: {self.name}: {note}")
        local = self.state.delivered(self.name)
        # The tracker's own marks win over the file's when newer: a kill can land between the two writes.
        self._delivered = {k: max(local.get(k, -1), opened.delivered.get(k, -1)) for k in {*local, *opened.delivered}}

    def _deliver(self, batch: list[tuple[str, Any]]) -> None:
        uploads = [payload for kind, payload in batch if kind == "upload"]
        update = self._update([payload for kind, payload in batch if kind == "record"])
        if update:
            self._retrying(lambda: self.tracker.send(update))
            self._delivered = update.delivered
            self.state.set_delivered(self.name, update.delivered)
        for path, kind in uploads:
            self._retrying(functools.partial(self.tracker.upload, path, kind))

    def _update(self, records: list[dict[str, Any]]) -> Update:
        update = Update(delivered=dict(self._delivered))
        for record in records:
            series = record_series(record)
            if series is not None:
                self._add(update, record, series)
                continue
            if self._backlog is not None and record.get("event") in ("start", "resume"):
                # Earlier attempts' records up to this attempt's first step, which a kill kept from being sent.
                for old in self._backlog.records(up_to_step=int(record.get("step", 0))):
                    self._add(update, old, record_series(old) or "")
                self._backlog = None
            tags, labels = lifecycle_tags(record, self.start, self.previous_world_size)
            update.tags.update(tags)
            update.labels.extend(labels)
        return update

    def _add(self, update: Update, record: dict[str, Any], series: str) -> None:
        if "step" not in record:
            return
        step = int(record["step"])
        if step <= update.delivered.get(series, -1):
            self.skipped += 1  # this step is already in the tracker: steps never go back
            return
        update.points.extend(record_points(record, series))
        update.delivered[series] = step

    def _retrying(self, call: Callable[[], None]) -> None:
        """Call until it succeeds; one warning when it starts failing, one line when it works again."""
        wait = RETRY_FIRST_S
        while True:
            try:
                call()
            except Exception as e:
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    self.say(
                        f"warning: {self.name}: {type(e).__name__}: {_first_line(e)}; retrying every "
                        f"{RETRY_FIRST_S:g}-{RETRY_MAX_S:g}s, keeping the newest {self.capacity} records "
                        f"meanwhile; training goes on"
                    )
                self._last_error = _first_line(e)
                if self._sleep_or_closed(wait):
                    raise _Closed from None
                wait = min(wait * 2, RETRY_MAX_S)
                continue
            if self._down_since is not None:
                down_s = time.monotonic() - self._down_since
                lost = self.dropped - self._reported_dropped
                self._reported_dropped = self.dropped
                self.say(
                    f"warning: {self.name}: reachable again after {down_s:.0f}s; {lost} record(s) were dropped "
                    f"(the queue was full), the rest delivered"
                    if lost
                    else f"{self.name}: reachable again after {down_s:.0f}s; every queued record delivered"
                )
                self._down_since = None
            return

    def _sleep_or_closed(self, seconds: float) -> bool:
        """Sleep; True when the flush deadline has passed (stop retrying)."""
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            if now >= self._deadline:
                return True
            if self._wake.wait(min(end, self._deadline) - now):
                self._wake.clear()
        return time.monotonic() >= self._deadline

    def _reason(self) -> str:
        if self._down_since is not None:
            return f"unreachable for {time.monotonic() - self._down_since:.0f}s: {self._last_error}"
        return "still delivering"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
