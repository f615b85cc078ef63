"""One error taxonomy: every error ddptrain raises on purpose carries the exit code it means.

    DdptrainError            1   a failure (the base; RankFailure and TrainingStopped are failures)
      UserError              2   bad input: config, environment, data, checkpoints, paths (one line)
      Contention             1   another process holds (or took over) a lock this one needs: retry, not bad input
      LeaseLost             73   another run took the run folder's lease: stopped, nothing more written
      Preempted             75   stopped on request after committing a checkpoint (EX_TEMPFAIL)
      Interrupted          130   Ctrl-C
      QuitAtOnce       75/130   a Ctrl-C during a stop quit at once: the first stop signal's code
The CLI maps exceptions to exit codes in one place (`cli.main`) by reading `exit_code`.
"""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_LEASE_LOST = 73  # EX_CANTCREAT from sysexits.h: the output (the run folder) is no longer this run's
EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h: "stopped early, resumable"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class DdptrainError(Exception):
    """Base of every error ddptrain raises deliberately; `exit_code` is what the command exits with."""

    exit_code = EXIT_FAILURE
    # True when the run already printed the error (rank 0's progress line): the CLI adds nothing.
    announced = False


class UserError(DdptrainError):
    """Bad input from the user (config, environment, data, checkpoints): exit code 2."""

    exit_code = EXIT_USAGE


class ConfigError(UserError):
    """The configuration or the command line is invalid."""


class DataError(UserError):
    """The data is missing or malformed."""


class CheckpointError(UserError):
    """No usable checkpoint where one was required."""


class LaunchError(UserError):
    """The launch environment (torchrun variables, devices) is inconsistent."""


class Contention(DdptrainError):
    """Another live process holds a lock this one needs past the wait, or took it over from this one (exit 1).

    Not bad input: nothing the user gave is wrong, and running the command again (after the other process
    ends) succeeds; a failure, so `ddptrain launch --max-restarts` may restart it, unlike exit 2.
    """


class TrainingStopped(DdptrainError):
    """Every rank stopped together at an agreed step because training cannot go on (exit 1)."""

    announced = True


class NonFiniteError(TrainingStopped):
    """Raised on every rank at once when train.on_nonfinite=stop and the gradient is NaN/inf."""


class CheckpointSaveError(TrainingStopped):
    """Raised on every rank at once when a save failed and ckpt.on_error=stop."""


class RankFailure(DdptrainError):
    """A failed step, with the triage summary as its message (the original is the __cause__)."""


class Preempted(DdptrainError):
    """Raised on every rank at the same step after the preemption checkpoint is committed."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, step: int, signal_name: str | None) -> None:
        super().__init__(f"stopped at step {step} on request ({signal_name or 'a signal on another rank'})")
        self.step = step
        self.signal_name = signal_name


class Interrupted(DdptrainError):
    """Ctrl-C (SIGINT): raised on every rank at the same step after its checkpoint is committed; exit 130."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, step: int, signal_name: str | None) -> None:
        super().__init__(f"interrupted at step {step} ({signal_name or 'Ctrl-C on another rank'})")
        self.step = step
        self.signal_name = signal_name


class LeaseLost(DdptrainError):
    """Another run took the run folder's lease: every rank stops at once, writing nothing more there (exit 73).

    Not resumable by running again (the folder is the other run's now) and not bad input: never restarted.
    new_owner: who holds the lease now (rank 0 read it); None on the ranks that learned it from rank 0.
    """

    exit_code = EXIT_LEASE_LOST

    def __init__(self, run_dir: str, step: int, new_owner: str | None) -> None:
        who = f"; it now belongs to {new_owner}" if new_owner else " (rank 0 read who took it)"
        super().__init__(
            f"another run took the lease on run folder {run_dir}{who}: stopped at step {step} without writing "
            f"anything more there (no checkpoint, no metrics) (exit {EXIT_LEASE_LOST})"
        )
        self.step = step
        self.new_owner = new_owner


class QuitAtOnce(DdptrainError):
    """A Ctrl-C during a stop: quit without waiting for the step or its checkpoint. The exit code stays the
    first stop signal's (130 after Ctrl-C, 75 after SIGTERM/SIGUSR1): a later signal only hurries a stop.

    kind: the ending ("interrupted" or "preempted"); first: the signal that started the stop.
    """

    def __init__(self, kind: str, first: str, step: int, exit_code: int) -> None:
        super().__init__(
            f"{kind} by {first}, then quit at once on Ctrl-C at step {step}: no checkpoint of this step; run the "
            f"same command again to resume from the newest checkpoint (exit {exit_code})"
        )
        self.kind, self.first, self.step = kind, first, step
        self.exit_code = exit_code
