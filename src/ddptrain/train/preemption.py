"""Coordinated stops: a stop request on any rank stops every rank at the same step.

SIGTERM or SIGUSR1 (what schedulers send before they kill a job) and SIGINT (Ctrl-C) only set a
flag. The ranks agree on it with a tiny all-reduce read one step later (train/agreement.py), so
they all stop after the same step and commit a checkpoint together. Then they exit with
errors.EXIT_PREEMPTED (75, EX_TEMPFAIL, "stopped early, resumable") after SIGTERM/SIGUSR1, or
errors.EXIT_INTERRUPTED (130) after Ctrl-C. Running the same command again resumes from that
checkpoint.

The first stop signal decides the exit code and the message; later signals only hurry it: a
later Ctrl-C quits at once, without waiting for the step or the save (KeyboardInterrupt), and the
exit code stays the first signal's (a SLURM requeue keyed on 75 still sees 75); a later SIGTERM or
SIGUSR1 changes nothing (the stop it asks for is already under way). With `hold_until_exit()`
(the `ddptrain` command) the handlers stay installed after the stop, and the command ignores stop
signals once it returns its exit code (`settle_for_exit`), so a signal arriving while the run closes
or the interpreter tears down cannot end it with 143 or 130 either. Ranks whose first
signals differ (rare: a launcher forwards one signal to all) agree on the larger level, the
scheduler's stop.

The same agreement carries a lost lease (checkpoint/lease.py): rank 0's heartbeat thread sets a
flag, rank 0 contributes LEASE_LOST, the largest level, and every rank stops at once without a
checkpoint.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from ddptrain import streams
from ddptrain.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, DdptrainError, Interrupted, Preempted, QuitAtOnce

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_SIGNALS = (*PREEMPT_SIGNALS, signal.SIGINT)
# What a rank contributes to the agreement (`level`); the largest wins on every rank. HOOK_STOP: a hook of the
# Python API asked for a stop (train/hooks.py): a committed checkpoint and a normal end, below any signal's stop.
NO_STOP, HOOK_STOP, INTERRUPT, PREEMPT, LEASE_LOST = 0, 1, 2, 3, 4
_EXIT_CODES = {INTERRUPT: EXIT_INTERRUPTED, PREEMPT: EXIT_PREEMPTED}

# This process's stop, once decided: (what stopped it, exit code). Read by the command's last handler
# (cli.py) when a late Ctrl-C reaches it.
_decided: list[tuple[str, int]] = []
_hold = [False]
_leave = [False]


def leave_without_teardown() -> None:
    """The exit code is decided and nothing is left to close (a launcher whose workers stopped on a signal): the
    process leaves at once with that code (cli.exit_with) instead of running the interpreter's teardown."""
    _leave[0] = True


def leaves_without_teardown() -> bool:
    """Whether leave_without_teardown() was called in this process."""
    return _leave[0]


def hold_until_exit() -> None:
    """The process exits when the run ends (`ddptrain train`): after a stop signal, keep catching stop
    signals until then, so that a later one cannot replace the first one's exit code."""
    _hold[0] = True


def settle_for_exit() -> None:
    """The command is returning its exit code: after a stop signal under hold_until_exit(), ignore the stop
    signals from now on, so that the interpreter's teardown cannot be cut short into 130 or 143."""
    if _hold[0] and _decided:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def decided_stop() -> tuple[str, int] | None:
    """(the signal that decided this process's stop, its exit code), or None when no stop signal came."""
    return _decided[-1] if _decided else None


class StopRequest:
    """Records stop signals while installed; the Trainer's StopAgreement tells every rank if any rank got one.

    announce: print a line to stderr at the first Ctrl-C (rank 0; the others stay quiet).
    lease_lost: returns who took the run folder's lease, None while this process holds it (rank 0).
    """

    def __init__(self, announce: bool = True, lease_lost: Callable[[], str | None] | None = None) -> None:
        self.signal_name: str | None = None
        self.announce = announce
        self.hurried_by: str | None = None  # a later Ctrl-C that quit at once
        self._signal_level = NO_STOP
        self._lease_lost = lease_lost
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> StopRequest:
        """Catch the stop signals from now on (before this, they end the process as usual)."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before install(); after a stop signal under
        hold_until_exit(), keep these until the process exits."""
        if not (_hold[0] and self._signal_level != NO_STOP):
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the step in progress (and its collectives) must finish on every rank.
        if self._signal_level != NO_STOP:
            if signum == signal.SIGINT:
                self.hurried_by = "SIGINT"
                raise KeyboardInterrupt  # a second Ctrl-C (or Ctrl-C during a stop): quit now, same exit code
            return  # SIGTERM/SIGUSR1 after the first signal: that stop is already under way
        self._signal_level = INTERRUPT if signum == signal.SIGINT else PREEMPT
        self.signal_name = signal.Signals(signum).name
        _decided.append((self.signal_name, _EXIT_CODES[self._signal_level]))
        if signum == signal.SIGINT and self.announce:
            # After the flag is set, and never failing: the same Ctrl-C may have ended the reader of
            # stderr (`| tee`). os.write, not print: a handler may run while print holds the stream's lock.
            streams.write_fd(
                2, b"\ninterrupted: stopping after this step and saving a checkpoint (Ctrl-C again to quit at once)\n"
            )

    @property
    def level(self) -> int:
        """What this rank contributes to the agreement: a lost lease, else its first stop signal's level."""
        if self._lease_lost is not None and self._lease_lost() is not None:
            return LEASE_LOST
        return self._signal_level

    @property
    def requested(self) -> bool:
        """True once this process received a stop signal (or lost its lease)."""
        return self.level != NO_STOP

    def new_owner(self) -> str | None:
        """Who took the run folder's lease, as this rank knows it (rank 0 only)."""
        return self._lease_lost() if self._lease_lost is not None else None

    def stop_error(self, step: int, agreed: int) -> DdptrainError:
        """What every rank raises after the agreed stop's checkpoint: Preempted (75) or Interrupted (130).

        agreed: the largest level over the ranks, as the agreement returned it.
        """
        name = self.signal_name if self._signal_level == agreed else None  # None: it came from another rank
        error: DdptrainError = Interrupted(step, name) if agreed == INTERRUPT else Preempted(step, name)
        _decided.append((name or "a signal on another rank", error.exit_code))  # what a late Ctrl-C keeps
        return error

    def quit_at_once(self, step: int) -> QuitAtOnce:
        """What a Ctrl-C that quit at once at `step` ends with: the ending and exit code the first stop
        signal decided (a Ctrl-C with no stop before it: interrupted, 130)."""
        decided = decided_stop()
        if self._signal_level == NO_STOP or decided is None:
            return QuitAtOnce("interrupted", "SIGINT", step, EXIT_INTERRUPTED)
        code = decided[1]
        kind = "interrupted" if code == EXIT_INTERRUPTED else "preempted"
        return QuitAtOnce(kind, self.signal_name or decided[0], step, code)
