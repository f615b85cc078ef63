"""Hang and failure triage: where each rank was, and which ranks did not arrive.

* A hang watchdog per rank (observe/watchdog.py): when a step makes no progress for k x its p99
  duration plus a margin (evaluation and checkpoints have budgets of their own), every rank that
  notices writes its forensics into run.dir/stacks/ (observe/forensics.py: Python and native
  stacks, the flight recorder's collectives), a rank on the same host describes the ranks that
  wrote nothing (stopped, dead), and the rank exits with code 1 so the launcher restarts the
  group. `ddptrain triage RUN_DIR` turns the folder into one verdict (review/verdict.py).
* On a failed step (a collective timed out, a peer vanished, an exception) the rank appends the
  traceback and its stacks to the same file, then checks in on the job's TCPStore: ranks whose collective failed mark themselves
  "arrived" and wait briefly for the others; a rank that failed on its own leaves its error
  there. The error then names the ranks (and hosts) that never checked in, and the errors others
  reported, so one log line points at the culprit. The store is the rendezvous store under
  `ddptrain launch` (hosted by the launcher of the rendezvous host), the workers' own under torchrun.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import secrets
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddptrain import streams
from ddptrain.dist import DistContext, broadcast_object
from ddptrain.endpoints import split_host_port
from ddptrain.errors import EXIT_FAILURE, RankFailure, UserError
from ddptrain.observe import forensics
from ddptrain.observe.runlog import PACKAGE_LOG
from ddptrain.observe.watchdog import Budgets, Hang, HangWatchdog
from ddptrain.run_folder import stacks_dir
from ddptrain.safe_files import ensure_dir, open_append_no_follow

log = logging.getLogger(__name__)

TRIAGE_STORE_ENV = "DDPTRAIN_TRIAGE_STORE"  # HOST:PORT of a store that outlives the workers (set by `ddptrain launch`)
ARRIVAL_WAIT_S = 2.0  # how long a rank whose collective failed waits at most for the others to check in
ARRIVAL_QUIET_S = 0.5  # ... and how long after the last one that did
REPORT_WAIT_S = 5.0  # how long a rank whose watchdog fired waits for the other ranks' forensics
_SHOWN = 8  # ranks named per list in one message
# Substrings of the errors gloo and NCCL raise when a peer is gone or a collective timed out.
_COLLECTIVE_MARKERS = ("gloo", "NCCL", "Timed out", "timed out", "Connection closed by peer", "Connection reset")


def is_collective_failure(exc: BaseException) -> bool:
    """True for errors of a collective (timeout, peer gone) rather than of this rank's own code."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_MARKERS)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


class Triage:
    """One per rank: the hang watchdog and the failure report; `setup()` on all ranks together.

    events: rank 0's metrics writer (`write(kind, **fields)`), for the hang event.
    """

    def __init__(
        self,
        ctx: DistContext,
        run_dir: Path,
        timeout_s: float,
        budgets: Budgets | None = None,
        events: Callable[..., None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.timeout_s = timeout_s
        self.hosts = list(ctx.hosts) or [ctx.hostname]
        self.stacks_dir = stacks_dir(run_dir)
        self.path = self.stacks_dir / f"{forensics.stacks_name(ctx.rank, ctx.hostname)}.txt"
        try:  # faulthandler needs a real file descriptor up front; a planted link or FIFO is refused here
            ensure_dir(self.stacks_dir, run_dir)
            self._file = open_append_no_follow(self.path)
        except OSError as e:
            raise UserError(f"cannot write the run's stacks file {self.path}: {e.strerror or e}") from None
        self._prefix = ""
        self.pids: list[int] = [os.getpid()]
        self._events = events
        budgets = budgets or Budgets(True, 3.0, 30.0, 20, timeout_s, timeout_s, timeout_s)
        self.watchdog = HangWatchdog(budgets, self._on_hang, log.info)

    def setup(self) -> None:
        """All ranks together: agree on a store key prefix unique to this worker group; learn every rank's pid.

        Restart counts differ between nodes, so they cannot name the group; rank 0's random token can.
        The pids let a rank describe a silent peer on its own host after a hang.
        """
        self._prefix = f"ddptrain/triage/{broadcast_object(self.ctx, secrets.token_hex(8))}"
        if self.ctx.is_distributed:
            pids: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(pids, os.getpid(), group=self.ctx.group)
            self.pids = [int(p) for p in pids]

    # ---- the loop's observer (train/hooks.py; Run.fit attaches it for the loop) ----------------

    def step_started(self, step: int) -> None:
        """Step `step` starts (or its next attempt, in place): its budget runs from now."""
        self.watchdog.arm(step)

    def step_trained(self, step: int) -> None:
        """The step finished: its duration calibrates the budget."""
        self.watchdog.disarm()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A phase with its own budget: "evaluation" or "checkpoint" (they never trip the step budget)."""
        with self.watchdog.phase(name):
            yield

    def _on_hang(self, hang: Hang) -> None:
        """The watchdog thread: write forensics, wait for the others', fail this rank (exit 1)."""
        ctx = self.ctx
        what = f"step {hang.step}" if hang.phase == "step" else f"{hang.phase} after step {hang.step}"
        text = (
            f"hang: rank {ctx.rank} on {ctx.hostname}: {what} made no progress "
            f"for {hang.waited_s:.2f} s (budget {hang.budget_s:.2f} s: {hang.derivation}); stacks in "
            f"{self.stacks_dir}; failing this rank so the launcher restarts the group "
            f"(`ddptrain triage` reads them)"
        )
        log.error("%s", text)
        streams.say(f"error: {text}")  # a broken stderr must not keep the hang from failing the rank
        facts = {
            "step": hang.step,
            "phase": hang.phase,
            "waited_s": round(hang.waited_s, 3),
            "budget_s": round(hang.budget_s, 3),
            "derivation": hang.derivation,
            "world_size": ctx.world_size,
            "hosts": self.hosts,
        }
        try:
            forensics.write_own(self.stacks_dir, ctx.rank, ctx.hostname, ctx.backend, ctx.group, facts)
            silent = forensics.observe_silent(self.stacks_dir, ctx.rank, self.hosts, self.pids, REPORT_WAIT_S)
            if self._events is not None:
                self._events(
                    "event",
                    event="hang",
                    step=hang.step,
                    rank=ctx.rank,
                    host=ctx.hostname,
                    phase=hang.phase,
                    waited_s=hang.waited_s,
                    budget_s=hang.budget_s,
                    silent_ranks=silent,
                )
        finally:
            for handler in PACKAGE_LOG.handlers:
                handler.flush()
            logging.shutdown()
            os._exit(EXIT_FAILURE)  # the main thread is stuck: only a process exit ends it

    def failed(self, exc: BaseException, step: int) -> RankFailure:
        """Record a failure in `step` (stacks, traceback, who arrived) and return the error to raise.

        A rank whose collective failed because another rank failed on its own says so first, with that
        rank's error, not the transport's (gloo's "Connection closed by peer" is in the stacks file)."""
        self.watchdog.stop()
        what = _first_line(exc)
        collective = is_collective_failure(exc)
        report, causes = self._check_in(collective, what) if self.ctx.is_distributed else ("", {})
        who = f"rank {self.ctx.rank} on {self.ctx.hostname}"
        if collective and causes:
            r, cause = min(causes.items())
            summary = f"{who} stopped in step {step} because rank {r} ({self.hosts[r]}) failed: {cause}"
        else:
            summary = f"{who} failed in step {step}: {what}{report}"
        summary += f"; stacks in {self.path}"
        self._file.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {summary}\n")
        self._file.write("".join(traceback.format_exception(exc)))
        self._file.write("--- all threads at the time of the report:\n")
        self._file.flush()
        faulthandler.dump_traceback(file=self._file, all_threads=True)
        self._file.flush()
        return RankFailure(summary)

    def idle(self) -> None:
        """The training loop is over: stop watching."""
        self.watchdog.stop()

    def close(self) -> None:
        """Stop the watchdog; remove the stacks file (and folder) when nothing was written to it."""
        self.watchdog.stop()
        self._file.close()
        if self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()
            try:
                self.path.parent.rmdir()  # only succeeds once no rank has anything in it
            except OSError:
                pass

    # ---- the check-in on the job's store ----------------------------------------------------

    def _name(self, ranks: list[int]) -> str:
        shown = ", ".join(f"{r} ({self.hosts[r]})" for r in ranks[:_SHOWN])
        return shown + (f" and {len(ranks) - _SHOWN} more" if len(ranks) > _SHOWN else "")

    def _check_in(self, collective: bool, what: str) -> tuple[str, dict[int, str]]:
        """Check in on the job's store; ("; who did not arrive; who reported what", {rank: its own error})."""
        try:
            # Under plain torchrun (no such variable) the workers' own store.
            host, port = split_host_port(os.environ.get(TRIAGE_STORE_ENV, "")) or (
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
            )
            store = dist.TCPStore(  # type: ignore[attr-defined]  # not in torch's __all__
                host, port, is_master=False, timeout=timedelta(seconds=ARRIVAL_WAIT_S), wait_for_workers=False
            )
            keys = [f"{self._prefix}/{r}" for r in range(self.ctx.world_size)]
            # A rank that failed on its own leaves its error and goes (its peers are blocked in
            # a collective until it exits); the others wait briefly for everyone to check in.
            store.set(keys[self.ctx.rank], "arrived" if collective else what)
            # Ranks failing in the same collective arrive within a fraction of a second of each
            # other; a dead one never does. So the wait ends once nobody new arrived for
            # ARRIVAL_QUIET_S, or after ARRIVAL_WAIT_S: it is on the critical path of every restart.
            start = time.monotonic()
            deadline, quiet_until = start + (ARRIVAL_WAIT_S if collective else 0.0), start + ARRIVAL_QUIET_S
            present: list[int] = []
            while True:
                arrived = [r for r, k in enumerate(keys) if store.check([k])]
                if len(arrived) > len(present):
                    quiet_until = time.monotonic() + ARRIVAL_QUIET_S
                present = arrived
                now = time.monotonic()
                if len(present) == len(keys) or now >= deadline or now >= quiet_until:
                    break
                time.sleep(0.05)
            waited = time.monotonic() - start
            errors = {r: store.get(keys[r]).decode() for r in present if r != self.ctx.rank}
        except (RuntimeError, KeyError, ValueError) as e:  # store gone with its host, link down, no torchrun
            return f"; could not reach the job's store to see which ranks arrived ({_first_line(e)})", {}
        parts = []
        missing = [r for r in range(self.ctx.world_size) if r not in present]
        if collective and missing:
            parts.append(f"did not arrive within {waited:.1f} s: rank {self._name(missing)}")
        causes = {r: err for r, err in sorted(errors.items()) if err != "arrived"}
        for r, err in causes.items():
            if len(parts) < _SHOWN:
                parts.append(f"rank {r} ({self.hosts[r]}) reported {err}")
        return "".join(f"; {p}" for p in parts), causes
