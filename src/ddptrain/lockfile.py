"""An exclusive lock file that also works on shared filesystems: the mechanism under the run lease
(checkpoint/lease.py) and the corpus preparer's lock (data/publish.py).

A lock is a small JSON file naming its owner (host, pid, job id, a token) and a heartbeat. It is
taken atomically with link(2) of a fully written private file onto its name: link fails with
EEXIST if the name exists, on local filesystems and on NFS alike (the classic NFS-safe lock;
O_EXCL is not reliable on old NFS, and flock is not shared between NFS clients). The owner
rewrites the heartbeat every HEARTBEAT_S seconds from a thread of its own.

A lock whose owner is dead is taken over: on the owner's own host (same pid namespace) when its
pid is gone or belongs to a newer process; from another host, when the owner was an earlier
round of this same torchrun job (same run id and SLURM requeue count: torchrun stops a round's
workers before it starts the next), or when its heartbeat is older than STALE_S (the nodes'
clocks must agree within that). Only one process may break a stale lock: it first takes
`NAME.break` the same way, re-reads the lock and replaces it only if it is still the stale one it
judged.

A lock file that names no owner that can be checked (unreadable, not JSON, a field of the wrong type:
`pid: "abc"`) is `UnreadableLock`. Our own writes never leave one (the file is always replaced whole).
`breaks_unreadable` says what a taker does with it: the prepare lock breaks it once a few seconds old,
the run lease refuses it (checkpoint/lease.py).

The holder's heartbeat thread also watches the lock: when the file names another owner (this
process stalled, was judged dead and the lock was taken over) or is gone (another process may have
taken it and released it between two heartbeats), `lost` is set to who took it and the callbacks
given to `when_lost` run once, on that thread; it never writes the lock again. An unreadable lock
file is not a loss: nobody can prove it is theirs either.
"""

from __future__ import annotations

import json
import math
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddptrain.safe_files import open_new_no_follow, read_bytes_no_follow

HEARTBEAT_S = 10.0
STALE_S = 90.0
_BREAK_STALE_S = 30.0  # a breaker that died mid-takeover leaves NAME.break this old at most
_MAX_BYTES = 1 << 16
_MAX_PID = 2**31 - 1  # os.kill takes a C int (Linux pids stay below 2**22)
_FIELDS: dict[str, type] = {
    "host": str,
    "pid": int,
    "pid_ns": str,
    "start": str,
    "job": str,
    "token": str,
    "taken": float,
    "heartbeat": float,
}


class UnreadableLock(Exception):
    """A lock file that exists but names no owner that can be checked; the message says why."""


@dataclass
class Owner:
    """Who holds a lock."""

    host: str
    pid: int
    pid_ns: str  # the pid namespace: a pid means something only inside its own namespace
    start: str  # the process's start time (from /proc): tells a reused pid from the owner
    job: str
    token: str
    taken: float
    heartbeat: float

    def describe(self) -> str:
        """`pid P on HOST (job J), heartbeat Ns ago` (or `Ns in the future (clock skew?)`)."""
        job = f", job {_printable(self.job)}" if self.job else ""
        return f"pid {self.pid} on {_printable(self.host)}{job}, heartbeat {heartbeat_age(self.heartbeat)}"


def heartbeat_age(heartbeat: float, now: float | None = None) -> str:
    """`12s ago`, or for a time ahead of this host's clock `12s in the future (clock skew?)`."""
    age = (time.time() if now is None else now) - heartbeat
    if age <= -0.5:  # another host's clock runs ahead of ours (or the file was edited)
        return f"{-age:.0f}s in the future (clock skew?)"
    return f"{max(0.0, age):.0f}s ago"


def _printable(text: str, limit: int = 120) -> str:
    """A name from a lock file as it may appear in one line: control characters escaped, length bounded."""
    shown = text if text.isprintable() else repr(text)[1:-1]
    return shown if len(shown) <= limit else shown[:limit] + "..."


def _proc_start(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _job_id() -> str:
    """The scheduler's job and torchrun's run id: equal for every round of one elastic job (and SLURM requeue count)."""
    parts = (
        [f"slurm {os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"]
        if os.environ.get("SLURM_JOB_ID")
        else []
    )
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        parts.append(f"torchrun {os.environ['TORCHELASTIC_RUN_ID']}")
    return ", ".join(parts)


def _earlier_round_of_this_job(owner: Owner) -> bool:
    """An owner from an earlier round of this same torchrun job: the agent stopped every worker of a round
    before starting the next, so that owner is gone even if its host (another node) cannot tell us."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and owner.job == _job_id() and owner.pid != os.getpid()


def me() -> Owner:
    """This process as a lock owner."""
    now = time.time()
    return Owner(
        socket.gethostname(), os.getpid(), _pid_ns(), _proc_start(os.getpid()), _job_id(), uuid.uuid4().hex, now, now
    )


def load_owner(path: Path) -> Owner | None:
    """The owner recorded in a lock file; None when there is none; UnreadableLock saying why it cannot be read."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block the open, a link is never followed
            raise UnreadableLock("is not a regular file")
        data = read_bytes_no_follow(path, _MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UnreadableLock(f"cannot be read ({e.strerror or e})") from None
    if len(data) > _MAX_BYTES:
        raise UnreadableLock(f"is larger than {_MAX_BYTES} bytes")
    try:
        raw = json.loads(data.decode())
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
        raise UnreadableLock("is not valid JSON") from None
    return _owner_from(raw)


def _owner_from(raw: Any) -> Owner:
    """An Owner from the decoded JSON, every field of its type (a string pid would reach os.kill)."""
    if not isinstance(raw, dict):
        raise UnreadableLock("is not a JSON object")
    values: dict[str, Any] = {}
    for name, kind in _FIELDS.items():
        if name not in raw:
            raise UnreadableLock(f"has no {name!r}")
        value = raw[name]
        if kind is str:
            ok = isinstance(value, str)
        elif kind is int:
            ok = type(value) is int and 1 <= value <= _MAX_PID
        else:
            ok = type(value) in (int, float) and abs(value) < 1e15 and math.isfinite(value)
        if not ok:
            raise UnreadableLock(f"has {name}: {_shown(value)}, not a valid {name}")
        values[name] = float(value) if kind is float else value
    return Owner(**values)


def _shown(value: Any) -> str:
    """A JSON value in a message: a scalar as written, bounded; a list or object by its kind."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return _printable(json.dumps(value)[:60], 60)


def read_owner(path: Path) -> Owner | None:
    """The owner recorded in a lock file; None when it is missing or unreadable (see load_owner)."""
    try:
        return load_owner(path)
    except UnreadableLock:
        return None


def is_alive(owner: Owner) -> bool:
    """Whether the owner may still be running (when in doubt: alive)."""
    if owner.host == socket.gethostname() and owner.pid_ns == _pid_ns() and owner.pid_ns:
        if owner.pid == os.getpid():
            return True
        try:
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, another user's
        return _proc_start(owner.pid) in ("", owner.start)
    if _earlier_round_of_this_job(owner):
        return False
    return time.time() - owner.heartbeat < STALE_S


def _publish(folder: Path, owner: Owner, name: str, private_name: str) -> bool:
    """Atomically create folder/name holding owner; False when the name exists."""
    private = folder / private_name
    with open_new_no_follow(private) as f:
        f.write(json.dumps(asdict(owner)).encode())
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(private, folder / name)
        return True
    except FileExistsError:
        return False
    finally:
        private.unlink()


class LockFile:
    """The lock folder/name, held by this process from a successful attempt() to release().

    breaks_unreadable: an unreadable lock file older than a few seconds is broken like a stale one
    (the prepare lock); False: attempt() raises UnreadableLock instead (the run lease, checkpoint/lease.py).
    """

    breaks_unreadable = True

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.name = name
        self.path = folder / name
        self.owner = me()
        self.took_over: Owner | None = None  # the dead owner whose stale lock this one replaced
        self.lost: str | None = None  # who took this lock from this process, described (heartbeat thread)
        self._on_lost: list[Callable[[str], None]] = []
        self._lost_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attempt(self) -> tuple[bool, Owner | None]:
        """One try: (True, None) when taken (the heartbeat runs), (False, holder) while a live holder has it,
        (False, None) when the lock was being written or a stale one was just broken (try again)."""
        if _publish(self.folder, self.owner, self.name, f"{self.name}.{self.owner.token}.tmp"):
            self._thread = threading.Thread(target=self._beat, name=f"{self.name}-heartbeat", daemon=True)
            self._thread.start()
            return True, None
        try:
            holder = load_owner(self.path)
        except UnreadableLock:
            if not self.breaks_unreadable:
                raise
            holder = None
        if holder is not None and is_alive(holder):
            return False, holder
        if holder is None and self.path.exists() and time.time() - self.path.stat().st_mtime < 5:
            time.sleep(0.2)  # being written right now
            return False, None
        self._break(holder)
        return False, None

    def when_lost(self, callback: Callable[[str], None]) -> None:
        """Call callback(who took it) once when this lock is seen taken (at once if it already was)."""
        with self._lost_lock:
            lost = self.lost
            if lost is None:
                self._on_lost.append(callback)
        if lost is not None:
            callback(lost)

    def taken_by(self) -> str | None:
        """Read the lock now: who took it from this process (described), or None while it is still ours (or
        unreadable: nothing proves it is another's; or released: then it is not this process's to check)."""
        if self.lost is None and self._thread is not None:
            self._check()
        return self.lost

    def _check(self) -> Owner | None:
        """The lock's owner when it is still this process's (else None, and `lost` says who took it)."""
        try:
            current = load_owner(self.path)
        except UnreadableLock:
            return None
        if current is None:
            self._lose(f"nobody now: {self.path} was removed (another run may have taken it and ended)")
        elif current.token != self.owner.token:
            self._lose(current.describe())
        else:
            return current
        return None

    def _lose(self, who: str) -> None:
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = who
            callbacks, self._on_lost = self._on_lost, []
        for callback in callbacks:
            callback(who)

    def held(self) -> bool:
        """Whether the lock file still names this process (a stalled owner may have been judged dead)."""
        current = read_owner(self.path)
        return current is not None and current.token == self.owner.token

    def _break(self, stale: Owner | None) -> None:
        """Remove the stale lock, guarded by NAME.break so that two breakers cannot both win."""
        guard = self.folder / f"{self.name}.break"
        if not _publish(self.folder, self.owner, guard.name, f"{guard.name}.{self.owner.token}.tmp"):
            breaker = read_owner(guard)
            if breaker is None or time.time() - breaker.taken > _BREAK_STALE_S:
                guard.unlink(missing_ok=True)  # a breaker died mid-takeover
            else:
                time.sleep(0.2)
            return
        try:
            try:
                current = load_owner(self.path)
            except UnreadableLock:
                if not self.breaks_unreadable:
                    return  # replaced by an unreadable file meanwhile: refused, never broken
                current = None
            if (current is None and stale is None) or (current and stale and current.token == stale.token):
                self.path.unlink(missing_ok=True)
                self.took_over = stale
        finally:
            guard.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._renew():
                return  # lost (taken over after a long stall): never overwrite another's lock

    def _renew(self) -> bool:
        """One heartbeat; False once the lock is lost (then `lost` says to whom)."""
        if self._check() is None:
            return self.lost is None  # unreadable: nobody can prove it is theirs either; beat again later
        self.owner.heartbeat = time.time()
        replacement = self.folder / f"{self.name}.{self.owner.token}.beat"
        try:
            replacement.unlink(missing_ok=True)
            with open_new_no_follow(replacement) as f:
                f.write(json.dumps(asdict(self.owner)).encode())
                f.flush()
                os.fsync(f.fileno())  # a crash right after the rename must not leave an empty lock file
            os.replace(replacement, self.path)
        except OSError:
            pass  # a full disk: the heartbeat ages, which other hosts read as a stall, never as ours to lose
        return True

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.held():
            self.path.unlink(missing_ok=True)
