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
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ddptrain.safe_files import open_new_no_follow, read_bytes_no_follow

HEARTBEAT_S = 10.0
STALE_S = 90.0
_BREAK_STALE_S = 30.0  # a breaker that died mid-takeover leaves NAME.break this old at most


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
        """`pid P on HOST (job J), heartbeat Ns ago`."""
        job = f", job {self.job}" if self.job else ""
        return f"pid {self.pid} on {self.host}{job}, heartbeat {max(0.0, time.time() - self.heartbeat):.0f}s ago"


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


def read_owner(path: Path) -> Owner | None:
    """The owner recorded in a lock file; None when it is missing or unreadable (a half-written one)."""
    try:
        raw = json.loads(read_bytes_no_follow(path, 1 << 16).decode())
        return Owner(**{k: raw[k] for k in Owner.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
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
    """The lock folder/name, held by this process from a successful attempt() to release()."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.name = name
        self.path = folder / name
        self.owner = me()
        self.took_over: Owner | None = None  # the dead owner whose stale lock this one replaced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attempt(self) -> tuple[bool, Owner | None]:
        """One try: (True, None) when taken (the heartbeat runs), (False, holder) while a live holder has it,
        (False, None) when the lock was being written or a stale one was just broken (try again)."""
        if _publish(self.folder, self.owner, self.name, f"{self.name}.{self.owner.token}.tmp"):
            self._thread = threading.Thread(target=self._beat, name=f"{self.name}-heartbeat", daemon=True)
            self._thread.start()
            return True, None
        holder = read_owner(self.path)
        if holder is not None and is_alive(holder):
            return False, holder
        if holder is None and self.path.exists() and time.time() - self.path.stat().st_mtime < 5:
            time.sleep(0.2)  # being written right now
            return False, None
        self._break(holder)
        return False, None

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
            current = read_owner(self.path)
            if (current is None and stale is None) or (current and stale and current.token == stale.token):
                self.path.unlink(missing_ok=True)
                self.took_over = stale
        finally:
            guard.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.held():
                return  # lost (taken over after a long stall): never overwrite another's lock
            self.owner.heartbeat = time.time()
            replacement = self.folder / f"{self.name}.{self.owner.token}.beat"
            try:
                replacement.unlink(missing_ok=True)
                with open_new_no_follow(replacement) as f:
                    f.write(json.dumps(asdict(self.owner)).encode())
                os.replace(replacement, self.path)
            except OSError:
                pass  # a full disk: the heartbeat ages, which other hosts read as a stall, never as ours to lose

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.held():
            self.path.unlink(missing_ok=True)
