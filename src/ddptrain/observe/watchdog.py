"""A hang watchdog per rank, its timeout calibrated from the run's own step times.

A thread on every rank watches the training loop's progress: the trainer marks each step's start
and end (`arm`/`disarm`) and wraps evaluation and checkpoint saves in `phase(...)`. When the
current phase makes no progress for longer than its budget, the watchdog calls `on_hang` (which
writes the stacks and fails the rank so the launcher restarts the group): the job learns of a hang
in seconds instead of after the collective timeout (`dist.timeout_s`; gloo's cannot be changed
after the process group exists, so detection is the watchdog's, as with NCCL's own watchdog).

Budgets: a step (and the short collectives between steps) gets `k x p99 + margin` once
`warmup_steps` steps were timed (the p99 over the last 1,000 steps, re-derived every 50). Before
that, and whenever that budget would not beat `dist.timeout_s`, it is `dist.timeout_s + margin`:
the collective timeout fires first and its own report (who did not arrive) applies. Evaluation gets
`dist.eval_timeout_s`, a checkpoint save `ckpt.timeout_s + margin`: slow but legitimate phases
never trip the step budget.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ddptrain.config import Config

_RECALIBRATE_EVERY = 50  # steps between re-derivations of the step budget
_KEPT = 1000  # step durations the p99 is taken over
_SKIP_FIRST = 2  # the first steps (allocation, compilation) never count
_POLL_S = 0.1


@dataclass(frozen=True)
class Budgets:
    """How the watchdog's budgets derive from the config."""

    enabled: bool
    k: float
    margin_s: float
    warmup_steps: int
    max_s: float  # the collective timeout: a budget above it defers to it
    eval_s: float
    checkpoint_s: float

    @classmethod
    def from_config(cls, cfg: Config) -> Budgets:
        """The budgets of `cfg.dist.watchdog*`, `dist.eval_timeout_s` and `ckpt.timeout_s`."""
        d = cfg.dist
        return cls(
            d.watchdog,
            d.watchdog_k,
            d.watchdog_margin_s,
            d.watchdog_warmup_steps,
            d.timeout_s,
            d.eval_timeout_s,
            cfg.ckpt.timeout_s + d.watchdog_margin_s,
        )


@dataclass(frozen=True)
class Hang:
    """What the watchdog saw when it fired."""

    step: int  # the step in progress (or the last one finished, between steps)
    phase: str  # "step", "between steps", "evaluation", "checkpoint"
    waited_s: float
    budget_s: float
    derivation: str


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by the nearest-rank method (no interpolation: a real observed value)."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))
    return ordered[index]


class HangWatchdog:
    """One per rank: a daemon thread comparing the time since the last progress with the phase's budget."""

    def __init__(self, budgets: Budgets, on_hang: Callable[[Hang], None], log: Callable[[str], None]) -> None:
        self.budgets, self.on_hang, self.log = budgets, on_hang, log
        self._lock = threading.Lock()
        self._phase: str | None = None  # None: not watching (before the loop, after it)
        self._since = time.monotonic()
        self._step = 0
        self._durations: deque[float] = deque(maxlen=_KEPT)
        self._timed = 0
        self.step_budget_s = budgets.max_s + budgets.margin_s
        self.derivation = f"dist.timeout_s {budgets.max_s:g} s + margin (not calibrated yet)"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: Hang | None = None
        self._calibrated = False

    # ---- what the training loop calls --------------------------------------------------------

    def arm(self, step: int) -> None:
        """Step `step` (1-based, the one about to run) starts."""
        self._start_thread()
        self._set(step, "step")

    def disarm(self) -> None:
        """The step finished: record its duration; between steps the step budget still applies."""
        with self._lock:
            if self._phase == "step":
                self._record(time.monotonic() - self._since)
            self._phase, self._since = "between steps", time.monotonic()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A phase with a budget of its own ("evaluation", "checkpoint"); then back to between steps."""
        with self._lock:
            before, step = self._phase, self._step
        self._set(step, name)
        try:
            yield
        finally:
            self._set(step, before if before is not None else "between steps")

    def stop(self) -> None:
        """Stop watching (the loop ended); the thread exits."""
        with self._lock:
            self._phase = None
        self._stop.set()

    # ---- inside -------------------------------------------------------------------------------

    def _set(self, step: int, phase: str) -> None:
        with self._lock:
            self._step, self._phase, self._since = step, phase, time.monotonic()

    def _start_thread(self) -> None:
        if self._thread is None and self.budgets.enabled:
            self._thread = threading.Thread(target=self._watch, name="ddptrain-hang-watchdog", daemon=True)
            self._thread.start()

    def _record(self, seconds: float) -> None:
        self._timed += 1
        if self._timed <= _SKIP_FIRST:
            return
        self._durations.append(seconds)
        n = len(self._durations)
        if n >= self.budgets.warmup_steps and (n == self.budgets.warmup_steps or n % _RECALIBRATE_EVERY == 0):
            self._calibrate()

    def _calibrate(self) -> None:
        b = self.budgets
        p99 = percentile(list(self._durations), 0.99)
        budget = b.k * p99 + b.margin_s
        previous, first = self.step_budget_s, not self._calibrated
        self._calibrated = True
        self.derivation = (
            f"{b.k:g} x p99 {p99:.3f} s + margin {b.margin_s:g} s = {budget:.2f} s, "
            f"p99 of the last {len(self._durations)} steps"
        )
        if budget >= b.max_s:
            budget = b.max_s + b.margin_s
            self.derivation += f"; not below dist.timeout_s {b.max_s:g} s, which fires first"
        self.step_budget_s = budget
        if first or abs(budget - previous) > 0.25 * previous:
            self.log(f"watchdog: step budget {self.derivation}")

    def budget(self, phase: str) -> float:
        """The budget of a phase, in seconds."""
        if phase == "evaluation":
            return self.budgets.eval_s
        if phase == "checkpoint":
            return self.budgets.checkpoint_s
        return self.step_budget_s

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            with self._lock:
                phase, step, waited = self._phase, self._step, time.monotonic() - self._since
            if phase is None:
                continue
            budget = self.budget(phase)
            if waited > budget:
                why = self.derivation if phase in ("step", "between steps") else f"the {phase} budget"
                self.fired = Hang(step, phase, waited, budget, why)
                self.on_hang(self.fired)
                return
