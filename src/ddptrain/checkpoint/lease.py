"""One writer per run folder: an exclusive lease on run.dir that also works on shared filesystems.

The lease is `run.dir/.lease`, a lock file (`ddptrain.lockfile`: taken with link(2), which is
atomic on NFS too, with the owner's host, pid, job id, a token and a heartbeat). A lease whose owner
is dead is taken over (its pid gone on the same host, an earlier round of the same torchrun job, or
a heartbeat older than STALE_S from another host). A live lease is refused with a LeaseHeld
(exit 2) naming the owner.

A lease file that names no owner that can be checked (unreadable, not JSON, `pid: "abc"`) is
refused too (exit 2), never taken over: nothing proves its owner dead, and a live run's lease must
never be taken from it. The line says how to clear it. ddptrain itself never leaves one (the file
is always replaced whole).

One writer per run folder across the modes: a plain run holds `.lease`, each replica group of the
in-place mode its own `.lease.group<N>` (run_folder.py). Whoever takes one then looks at the other
mode's: a live (or unreadable) one is refused the same way, after this lease is let go again. Two
starting at once may both be refused; never both accepted (each takes its own before it looks).

`live_tokens` names the writers a temp folder may still belong to (checkpointer.py removes the rest).

A run whose lease was taken (it stalled past STALE_S and another host judged it dead, or someone
edited or removed the file) learns it from its heartbeat thread (`lost`, `when_lost`) and before every
commit (`taken_by`); it then stops writing into the folder and exits EXIT_LEASE_LOST (run.py, train/).
"""

from __future__ import annotations

import time
from pathlib import Path

from ddptrain.errors import UserError
from ddptrain.lockfile import (
    HEARTBEAT_S,
    STALE_S,
    LockFile,
    Owner,
    UnreadableLock,
    is_alive,
    load_owner,
    me,
    read_owner,
)
from ddptrain.run_folder import LEASE, lease_files

__all__ = ["HEARTBEAT_S", "STALE_S", "LeaseHeld", "Owner", "RunLease", "live_tokens", "me", "read_owner"]


class LeaseHeld(UserError):
    """Another live run holds the run folder, or its lease file names no owner that can be checked."""


class RunLease(LockFile):
    """The lease on one run folder, held by this process from acquire() to release()."""

    breaks_unreadable = False  # an unreadable lease has no provable owner: refused, never taken over

    def __init__(self, run_dir: Path, name: str = LEASE) -> None:
        # name: another lease file beside the run's, e.g. one per replica group in the in-place mode
        super().__init__(run_dir, name)
        self.run_dir = run_dir

    def acquire(self, attempts: int = 5) -> RunLease:
        """Take the lease or raise LeaseHeld naming the live owner (or why the lease file is unreadable);
        starts the heartbeat."""
        unreadable: UnreadableLock | None = None
        for attempt in range(attempts):
            try:
                taken, holder = self.attempt()
            except UnreadableLock as e:
                if unreadable is not None or attempt + 1 == attempts:
                    unreadable = e
                    break
                unreadable = e  # read once more, shortly: an editor may be saving it right now
                time.sleep(0.2)
                continue
            if taken:
                self._refuse_the_other_mode()
                return self
            if holder is not None:
                raise LeaseHeld(
                    f"run folder {self.run_dir} is in use by another run ({holder.describe()}); wait for it to end, "
                    f"or train into another folder (run.name=NEW_NAME or run.dir=...)"
                )
        if unreadable is not None:
            raise LeaseHeld(
                f"run folder {self.run_dir}: its lease file {self.path} {unreadable}, so it names no owner that can "
                f"be checked and is neither honoured nor taken over; if no run is training into this folder, remove "
                f"{self.path} and start again"
            )
        raise LeaseHeld(f"could not take the lease on {self.run_dir}: other runs keep taking it")

    def _refuse_the_other_mode(self) -> None:
        """Just taken: LeaseHeld (this lease let go again) when a run of the other mode holds the folder."""
        plain, groups = lease_files(self.run_dir)
        rivals = groups if self.name == LEASE else [plain] if plain is not None else []
        for rival in rivals:
            try:
                holder = load_owner(rival)
            except UnreadableLock as e:
                self.release()
                raise LeaseHeld(
                    f"run folder {self.run_dir}: its lease file {rival} {e}, so another run may be training into "
                    f"it; if none is, remove {rival} and start again"
                ) from None
            if holder is not None and is_alive(holder):
                self.release()
                who = "a run" if rival.name == LEASE else f"replica group {rival.name.rsplit('group', 1)[1]}"
                raise LeaseHeld(
                    f"run folder {self.run_dir} is in use by {who} of another mode ({holder.describe()}): one "
                    "writer per folder; wait for it to end, or train into another folder (run.name=NEW_NAME or "
                    "run.dir=...)"
                )

    def lost_to(self) -> str | None:
        """Who took this lease, as the heartbeat thread saw it (no file read: asked every step)."""
        return self.lost

    def check_lost(self) -> str | None:
        """Read the lease file now (before a commit): who took it, or None while it is this run's."""
        return self.taken_by()


def live_tokens(run_dir: Path) -> set[str] | None:
    """The tokens of the live holders of run.dir's leases (every mode's): the writers whose temp folders may be
    saves in progress. None when a lease file cannot be read: then nothing proves any writer dead."""
    plain, groups = lease_files(run_dir)
    tokens: set[str] = set()
    for path in ([plain] if plain is not None else []) + groups:
        try:
            owner = load_owner(path)
        except UnreadableLock:
            return None
        if owner is not None and is_alive(owner):
            tokens.add(owner.token)
    return tokens
