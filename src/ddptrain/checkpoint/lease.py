"""One writer per run folder: an exclusive lease on run.dir that also works on shared filesystems.

The lease is `run.dir/.lease`, a lock file (`ddptrain.lockfile`: taken with link(2), which is
atomic on NFS too, with the owner's host, pid, job id and a heartbeat). A lease whose owner is
dead is taken over (its pid gone on the same host, an earlier round of the same torchrun job, or
a heartbeat older than STALE_S from another host). A live lease is refused with a LeaseHeld
(exit 2) naming the owner.
"""

from __future__ import annotations

from pathlib import Path

from ddptrain.errors import UserError
from ddptrain.lockfile import HEARTBEAT_S, STALE_S, LockFile, Owner, me, read_owner

__all__ = ["HEARTBEAT_S", "LEASE", "STALE_S", "LeaseHeld", "Owner", "RunLease", "me", "read_owner"]

LEASE = ".lease"


class LeaseHeld(UserError):
    """Another live run holds the run folder."""


class RunLease(LockFile):
    """The lease on one run folder, held by this process from acquire() to release()."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir, LEASE)
        self.run_dir = run_dir

    def acquire(self, attempts: int = 5) -> RunLease:
        """Take the lease or raise LeaseHeld naming the live owner; starts the heartbeat."""
        for _ in range(attempts):
            taken, holder = self.attempt()
            if taken:
                return self
            if holder is not None:
                raise LeaseHeld(
                    f"run folder {self.run_dir} is in use by another run ({holder.describe()}); wait for it to end, "
                    f"or train into another folder (run.name=NEW_NAME or run.dir=...)"
                )
        raise LeaseHeld(f"could not take the lease on {self.run_dir}: other runs keep taking it")
