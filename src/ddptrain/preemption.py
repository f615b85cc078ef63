"""Coordinated preemption: a stop request on any rank stops every rank at the same step.

SIGTERM or SIGUSR1 (what schedulers send before they kill a job) only sets a flag. At each step
boundary the ranks agree on it with one tiny all-reduce (MAX), so they all stop after the same
step, commit a checkpoint together and exit with EXIT_PREEMPTED (75, EX_TEMPFAIL): "stopped
early, resumable". Running the same command again resumes from that checkpoint.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

from ddptrain.dist import DistContext, any_rank

EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised on every rank at the same step after the preemption checkpoint is committed."""

    def __init__(self, step: int, signal_name: str | None) -> None:
        super().__init__(f"stopped at step {step} on request ({signal_name or 'a signal on another rank'})")
        self.step = step
        self.signal_name = signal_name


class StopRequest:
    """Records SIGTERM/SIGUSR1 while installed; `agreed()` tells every rank whether any rank got one."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
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
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        """True once this process received a stop signal."""
        return self.signal_name is not None

    def agreed(self, ctx: DistContext) -> bool:
        """All ranks, at the same step: True on every rank when any rank received a stop signal."""
        return any_rank(ctx, self.requested)
