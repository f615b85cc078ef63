"""Coordinated stops: a stop request on any rank stops every rank at the same step.

SIGTERM or SIGUSR1 (what schedulers send before they kill a job) and SIGINT (Ctrl-C) only set a
flag. The ranks agree on it with a tiny all-reduce read one step later (train/agreement.py), so
they all stop after the same step and commit a checkpoint together. Then they exit with
errors.EXIT_PREEMPTED (75, EX_TEMPFAIL, "stopped early, resumable") after SIGTERM/SIGUSR1, or
errors.EXIT_INTERRUPTED (130) after Ctrl-C; when both arrived, the scheduler's stop wins (it may
requeue the job). Running the same command again resumes from that checkpoint. A second Ctrl-C
quits at once (KeyboardInterrupt), without waiting for the step or the save.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

from ddptrain import streams
from ddptrain.errors import DdptrainError, Interrupted, Preempted

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_SIGNALS = (*PREEMPT_SIGNALS, signal.SIGINT)
# What a rank contributes to the agreement (`level`); the largest wins on every rank.
NO_STOP, INTERRUPT, PREEMPT = 0, 1, 2


class StopRequest:
    """Records stop signals while installed; the Trainer's StopAgreement tells every rank if any rank got one.

    announce: print a line to stderr at the first Ctrl-C (rank 0; the others stay quiet).
    """

    def __init__(self, announce: bool = True) -> None:
        self.signal_name: str | None = None
        self.announce = announce
        self.level = NO_STOP
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> StopRequest:
        """Catch the stop signals from now on (before this, they end the process as usual)."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before install()."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the step in progress (and its collectives) must finish on every rank.
        if signum == signal.SIGINT and self.level != NO_STOP:
            raise KeyboardInterrupt  # a second Ctrl-C (or Ctrl-C during a stop): quit now
        level = INTERRUPT if signum == signal.SIGINT else PREEMPT
        first = self.level == NO_STOP
        if level > self.level:
            self.level = level
            self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT and first and self.announce:
            # After the flag is set, and never failing: the same Ctrl-C may have ended the reader of
            # stderr (`| tee`). os.write, not print: a handler may run while print holds the stream's lock.
            streams.write_fd(
                2, b"\ninterrupted: stopping after this step and saving a checkpoint (Ctrl-C again to quit at once)\n"
            )

    @property
    def requested(self) -> bool:
        """True once this process received a stop signal."""
        return self.level != NO_STOP

    def stop_error(self, step: int, agreed: int) -> DdptrainError:
        """What every rank raises after the agreed stop's checkpoint: Preempted (75) or Interrupted (130).

        agreed: the largest level over the ranks, as the agreement returned it.
        """
        name = self.signal_name if self.level == agreed else None  # None: it came from another rank
        if agreed == INTERRUPT:
            return Interrupted(step, name)
        return Preempted(step, name)
