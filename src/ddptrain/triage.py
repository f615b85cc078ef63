"""Hang and failure triage: where each rank was, and which ranks did not arrive.

* A stack watchdog per step: when one training step takes longer than dist.timeout_s (a rank
  stuck in data loading, in a collective, in user code), faulthandler writes the Python stacks of
  all threads to run.dir/stacks/rank-<r>-<host>.txt, without stopping the process. Ranks that are
  merely waiting show the collective they wait in; the stuck rank shows where it is stuck.
* On a failed step (a collective timed out, a peer vanished, an exception) the rank appends the
  traceback and its stacks to the same file, then checks in on the job's TCPStore: ranks whose collective failed mark themselves
  "arrived" and wait briefly for the others; a rank that failed on its own leaves its error
  there. The error then names the ranks (and hosts) that never checked in, and the errors others
  reported, so one log line points at the culprit. The store is the rendezvous store under
  `ddptrain launch` (hosted by the launcher of the rendezvous host), the workers' own under torchrun.
"""

from __future__ import annotations

import faulthandler
import os
import secrets
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ddptrain.dist import DistContext

TRIAGE_STORE_ENV = "DDPTRAIN_TRIAGE_STORE"  # HOST:PORT of a store that outlives the workers (set by `ddptrain launch`)
ARRIVAL_WAIT_S = 2.0  # how long a rank whose collective failed waits for the others to check in
_SHOWN = 8  # ranks named per list in one message
# Substrings of the errors gloo and NCCL raise when a peer is gone or a collective timed out.
_COLLECTIVE_MARKERS = ("gloo", "NCCL", "Timed out", "timed out", "Connection closed by peer", "Connection reset")


class RankFailure(RuntimeError):
    """A failed step, with the triage summary as its message (the original is the __cause__)."""


def is_collective_failure(exc: BaseException) -> bool:
    """True for errors of a collective (timeout, peer gone) rather than of this rank's own code."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_MARKERS)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


class Triage:
    """One per rank: the per-step stack watchdog and the failure report. Create on all ranks together."""

    def __init__(self, ctx: DistContext, run_dir: Path, timeout_s: float) -> None:
        self.ctx = ctx
        self.timeout_s = timeout_s
        self.path = run_dir / "stacks" / f"rank-{ctx.rank}-{ctx.hostname}.txt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # faulthandler needs a real file descriptor up front
        self.hosts = [ctx.hostname]
        self._prefix = ""
        if ctx.is_distributed:
            # Hostnames for the report, and a key prefix unique to this worker group (restart
            # counts differ between nodes, so they cannot name it).
            gathered: list[tuple[str, str] | None] = [None] * ctx.world_size
            dist.all_gather_object(gathered, (ctx.hostname, secrets.token_hex(8)))
            self.hosts = [g[0] for g in gathered if g is not None]
            self._prefix = f"ddptrain/triage/{gathered[0][1] if gathered[0] else ''}"

    def arm(self) -> None:
        """Start the watchdog for one step: dump all stacks if it is still running after timeout_s."""
        faulthandler.dump_traceback_later(self.timeout_s, repeat=False, file=self._file, exit=False)

    def disarm(self) -> None:
        """The step finished in time: cancel the watchdog."""
        faulthandler.cancel_dump_traceback_later()

    def failed(self, exc: BaseException, step: int) -> RankFailure:
        """Record a failure in `step` (stacks, traceback, who arrived) and return the error to raise."""
        self.disarm()
        what = _first_line(exc)
        report = self._check_in(is_collective_failure(exc), what) if self.ctx.is_distributed else ""
        summary = f"rank {self.ctx.rank} on {self.ctx.hostname} failed in step {step}: {what}{report}; stacks in {self.path}"
        self._file.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {summary}\n")
        self._file.write("".join(traceback.format_exception(exc)))
        self._file.write("--- all threads at the time of the report:\n")
        self._file.flush()
        faulthandler.dump_traceback(file=self._file, all_threads=True)
        self._file.flush()
        return RankFailure(summary)

    def close(self) -> None:
        """Stop the watchdog; remove the stacks file when nothing was written to it."""
        self.disarm()
        self._file.close()
        if self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()

    # ---- the check-in on the job's store ----------------------------------------------------

    def _name(self, ranks: list[int]) -> str:
        shown = ", ".join(f"{r} ({self.hosts[r]})" for r in ranks[:_SHOWN])
        return shown + (f" and {len(ranks) - _SHOWN} more" if len(ranks) > _SHOWN else "")

    def _check_in(self, collective: bool, what: str) -> str:
        try:
            host, _, port = os.environ.get(TRIAGE_STORE_ENV, "").rpartition(":")
            if not host:  # plain torchrun: the workers' own store
                host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=ARRIVAL_WAIT_S),
                                  wait_for_workers=False)
            keys = [f"{self._prefix}/{r}" for r in range(self.ctx.world_size)]
            # A rank that failed on its own leaves its error and goes (its peers are blocked in
            # a collective until it exits); the others wait briefly for everyone to check in.
            store.set(keys[self.ctx.rank], "arrived" if collective else what)
            deadline = time.monotonic() + (ARRIVAL_WAIT_S if collective else 0.0)
            while True:
                present = [r for r, k in enumerate(keys) if store.check([k])]
                if len(present) == len(keys) or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            errors = {r: store.get(keys[r]).decode() for r in present if r != self.ctx.rank}
        except (RuntimeError, KeyError, ValueError) as e:  # store gone with its host, link down, no torchrun
            return f"; could not reach the job's store to see which ranks arrived ({_first_line(e)})"
        parts = []
        missing = [r for r in range(self.ctx.world_size) if r not in present]
        if collective and missing:
            parts.append(f"did not arrive within {ARRIVAL_WAIT_S:g} s: rank {self._name(missing)}")
        for r, err in sorted(errors.items()):
            if err != "arrived" and len(parts) < _SHOWN:
                parts.append(f"rank {r} ({self.hosts[r]}) reported {err}")
        return "".join(f"; {p}" for p in parts)
