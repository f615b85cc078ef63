"""A replica group that stops answering is evicted from the step in flight within seconds (the in-place mode).

torchft's Manager heartbeats to the Lighthouse from threads of its own (every 100 ms), whatever the training
loop is doing, so a group whose heartbeat stops is frozen (SIGSTOP, a host that stopped running it) or cut
off. The Lighthouse leaves such a group out of the next quorum, but the groups already in a step with it wait
in its collectives: gloo has no deadline of its own short of dist.ft_timeout_s (30 s by default). A dead
group costs ~1 s because its sockets close; a frozen one keeps them open.

`PeerWatch.track` follows this rank's cross-group collectives. Once one has been pending for STALL_S, a thread
reads the Lighthouse's status page every POLL_S (torchft 0.2.0 serves `/status`: each replica's time since
its last heartbeat, marked `old` past the Lighthouse's heartbeat timeout). When a group of the step's quorum
has been silent for SILENT_S and the Lighthouse holds it old, every tracked collective fails with `Evicted`:
the step is discarded, the cross-group process group aborted (InPlaceSession.abandon_collectives), and the
next quorum, which the Lighthouse forms without the silent group, goes on. When that group wakes, its own
collectives may still complete against the survivors' abandoned ones (gloo cannot abort those without
waiting for them), so each rank also watches itself: the watch thread ticks every POLL_S, and a step during
which it missed SILENT_S of ticks (`frozen_s`: the process was stopped, as long as the others take to evict
it) is discarded by the group itself (the in-place sync's commit, train/sync/in_place.py); it then finds itself
behind at its next quorum and heals, as any group that comes back does. A page that cannot be read or parsed evicts nobody
(dist.ft_timeout_s still bounds the wait).

A hang that leaves the heartbeat running (one rank of a several-rank group frozen while its rank 0 is not, a
deadlock in Python) is not seen here: dist.ft_timeout_s bounds it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

STALL_S = 1.0  # a collective pending this long makes the watch ask the Lighthouse
POLL_S = 0.25
SILENT_S = 2.0  # a group silent this long (and old to the Lighthouse) is evicted
READ_TIMEOUT_S = 1.0
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(\S+): seen ([0-9.]+)(ns|µs|us|ms|s) ago')
_UNIT_S = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


class Evicted(RuntimeError):
    """A collective given up on: a group of the step's quorum stopped answering."""


@dataclass(frozen=True)
class Heartbeat:
    """What the Lighthouse knows of one replica's heartbeat."""

    age_s: float
    old: bool  # past the Lighthouse's heartbeat timeout


@dataclass(frozen=True)
class Eviction:
    """Who was evicted from the step in flight, and how long the quietest of them had been silent."""

    groups: list[int]
    silent_s: float


def parse_heartbeats(page: str) -> dict[str, Heartbeat]:
    """The heartbeats listed on torchft 0.2.0's Lighthouse status page, by replica id (empty when none parse)."""
    return {
        m.group(2): Heartbeat(float(m.group(3)) * _UNIT_S[m.group(4)], m.group(1) is not None)
        for m in _HEARTBEAT.finditer(page)
    }


def group_of(replica_id: str) -> int | None:
    """The group id in a replica id of the in-place mode (`g<N>:<uuid>`); None for another form."""
    head = replica_id.split(":", 1)[0]
    return int(head[1:]) if head.startswith("g") and head[1:].isdigit() else None


def silent_groups(heartbeats: dict[str, Heartbeat], participants: list[str], own: int) -> Eviction | None:
    """The groups of `participants` (replica ids) other than `own` that the Lighthouse holds old and that have been
    silent for SILENT_S; None when there are none."""
    silent: dict[int, float] = {}
    for replica in participants:
        beat, group = heartbeats.get(replica), group_of(replica)
        if beat is not None and group is not None and group != own and beat.old and beat.age_s >= SILENT_S:
            silent[group] = beat.age_s
    return Eviction(sorted(silent), round(min(silent.values()), 2)) if silent else None


def live_outsiders(heartbeats: dict[str, Heartbeat], participants: list[str], own: int) -> list[int]:
    """The groups other than `own` whose heartbeat the Lighthouse holds live (not old) and that have no replica among
    `participants` (the quorum's replica ids), by group id."""
    inside = {group_of(replica) for replica in participants}
    groups = {group_of(replica) for replica, beat in heartbeats.items() if not beat.old}
    return sorted(g for g in groups if g is not None and g != own and g not in inside)


class RecordingClient:
    """torchft's ManagerClient with each quorum's replica ids handed to `record` (the step's participants)."""

    def __init__(self, client: Any, record: Callable[[list[str]], None]) -> None:
        self._client, self._record = client, record

    def _quorum(self, **kwargs: Any) -> Any:
        """ManagerClient._quorum, recording who is in the quorum."""
        result = self._client._quorum(**kwargs)
        self._record(list(result.replica_ids))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class PeerWatch:
    """Evicts silent groups from this rank's pending cross-group collectives; see the module docstring."""

    def __init__(self, status_url: str, own_group: int) -> None:
        """status_url: the Lighthouse's status page (http://HOST:PORT/status)."""
        self.status_url, self.own = status_url, own_group
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[float, torch.futures.Future[Any]]] = {}
        self._participants: list[str] = []
        self._eviction: Eviction | None = None
        self._unreadable = False  # said once
        self._closed = threading.Event()
        self._tick = time.monotonic()
        self._gap = 0.0  # the longest time between two ticks since mark()
        self._thread = threading.Thread(target=self._watch, name="ddptrain-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        """Start the watching thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching."""
        self._closed.set()

    def quorum_formed(self, replica_ids: list[str]) -> None:
        """The replica ids of the quorum this rank's next collectives run in."""
        with self._lock:
            self._participants = replica_ids

    def outsiders(self) -> list[int]:
        """The groups that heartbeat to the Lighthouse now but are not in the last quorum (none when its page cannot
        be read)."""
        with self._lock:
            participants = list(self._participants)
        return live_outsiders(self._heartbeats(), participants, self.own)

    def track(self, fut: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
        """A future completed as `fut` is, or failed with Evicted when a group of the quorum stops answering first."""
        out: torch.futures.Future[Any] = torch.futures.Future()
        key = id(out)
        with self._lock:
            self._pending[key] = (time.monotonic(), out)

        def settle(done: torch.futures.Future[Any]) -> None:
            with self._lock:
                if self._pending.pop(key, None) is None:
                    return  # evicted first
            try:
                out.set_result(done.value())
            except Exception as e:  # the collective's own failure: passed on as it is
                out.set_exception(e)

        fut.add_done_callback(settle)
        return out

    def mark(self) -> None:
        """A step starts: frozen_s() counts from here (what came before, a long save holding the GIL, does not)."""
        with self._lock:
            self._gap, self._tick = 0.0, time.monotonic()

    def frozen_s(self) -> float:
        """The longest stretch since mark() in which the watch thread did not run (this process was stopped)."""
        with self._lock:
            return max(self._gap, time.monotonic() - self._tick)

    def take_eviction(self) -> Eviction | None:
        """The eviction since the last call, if any (the trainer records it with the discarded step)."""
        with self._lock:
            eviction, self._eviction = self._eviction, None
        return eviction

    def _stalled(self) -> bool:
        with self._lock:
            oldest = min((t for t, _ in self._pending.values()), default=None)
        return oldest is not None and time.monotonic() - oldest >= STALL_S

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            now = time.monotonic()
            with self._lock:
                self._gap, self._tick = max(self._gap, now - self._tick), now
            if not self._stalled():
                continue
            with self._lock:
                participants = list(self._participants)
            eviction = silent_groups(self._heartbeats(), participants, self.own)
            if eviction is not None:
                self._evict(eviction)

    def _heartbeats(self) -> dict[str, Heartbeat]:
        try:
            with urllib.request.urlopen(self.status_url, timeout=READ_TIMEOUT_S) as page:
                beats = parse_heartbeats(page.read().decode("utf-8", "replace"))
        except (OSError, ValueError) as e:
            beats, why = {}, f"{type(e).__name__}: {e}"
        else:
            why = "" if beats else "no heartbeat listed"
        if why and not self._unreadable:
            self._unreadable = True
            log.warning(
                "cannot read the Lighthouse's heartbeats at %s (%s): a frozen group is waited for up to "
                "dist.ft_timeout_s",
                self.status_url,
                why,
            )
        return beats

    def _evict(self, eviction: Eviction) -> None:
        with self._lock:
            pending = [out for _, out in self._pending.values()]
            self._pending.clear()
            self._eviction = eviction
        why = f"replica group(s) {eviction.groups} stopped answering (no heartbeat for {eviction.silent_s:g} s)"
        for out in pending:
            out.set_exception(Evicted(why))
