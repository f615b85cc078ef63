"""Hooks of the Python API: watch a run, and stop it, without subclassing the Trainer.

`ddptrain.train(..., hooks=[obj])`: obj defines any of on_log(record), on_eval(record) and
on_checkpoint(record). Each receives a read-only copy (a MappingProxyType) of the record metrics.jsonl
gets: a logged step's, an evaluation's, a committed checkpoint's. A method that returns True (or a
non-empty string, the reason) asks the run to stop: the request travels the stop agreement of
preemption (train/agreement.py), so every rank stops after the same step (the agreement started after
the next step carries it: two steps after the request), with a committed checkpoint, and the run ends "finished_early" (exit 0; RunResult.status "finished_early").

Hooks run on every rank, with that rank's record: the loss, metrics and evaluations are all-reduced
(the same everywhere), timings are the rank's own; a stop asked on any one rank stops them all.

The run's own observers (the watchdog, throughput, the resume certificate, the straggler and replica
checks) attach to the same loop through `Observers`, the internal side of this seam: the Trainer announces
each event of `LoopObserver` in one place, and run.py builds the observers and attaches them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from types import MappingProxyType
from typing import Any, Protocol

from ddptrain.errors import ConfigError
from ddptrain.train.preemption import HOOK_STOP, NO_STOP

HOOK_METHODS = ("on_log", "on_eval", "on_checkpoint")
StopAnswer = bool | str | None  # what a hook method returns: True or a reason stops the run


class TrainingHook(Protocol):
    """The methods a hook may define (any of them; one is enough)."""

    def on_log(self, record: Mapping[str, Any]) -> StopAnswer:
        """A logged step's record (step, loss, lr, grad_norm, your metrics, ...)."""

    def on_eval(self, record: Mapping[str, Any]) -> StopAnswer:
        """An evaluation's record (step, val_loss, val_<name>)."""

    def on_checkpoint(self, record: Mapping[str, Any]) -> StopAnswer:
        """A committed checkpoint's record (step, path, seconds)."""


class Hooks:
    """The run's hooks; `call` hands them a record, `stop_reason` says whether one asked to stop."""

    def __init__(self, hooks: Sequence[object] = ()) -> None:
        for hook in hooks:
            if not any(callable(getattr(hook, m, None)) for m in HOOK_METHODS):
                raise ConfigError(f"hook {type(hook).__name__} defines none of {', '.join(HOOK_METHODS)}")
        self.hooks = list(hooks)
        self.stop_reason: str | None = None  # this rank's first stop request

    def call(self, method: str, record: Mapping[str, Any]) -> None:
        """Each hook's `method` with a read-only copy of record; the first stop answer is kept."""
        for hook in self.hooks:
            fn = getattr(hook, method, None)
            if not callable(fn):
                continue
            answer = fn(MappingProxyType(copy.deepcopy(dict(record))))
            if answer and self.stop_reason is None:
                why = answer if isinstance(answer, str) else "asked to stop"
                self.stop_reason = f"{type(hook).__name__}.{method} at step {record.get('step', '?')}: {why}"

    @property
    def level(self) -> int:
        """What this rank contributes to the stop agreement: HOOK_STOP once a hook asked."""
        return HOOK_STOP if self.stop_reason is not None else NO_STOP

    def agreed_reason(self, agreed: int) -> str | None:
        """Why the run stops when the ranks agreed on a hook's stop (a rank that did not ask says so); else None."""
        if agreed != HOOK_STOP:
            return None
        return (
            f"a hook asked to stop: {self.stop_reason}" if self.stop_reason else "a hook on another rank asked to stop"
        )


class LoopObserver(Protocol):
    """The events an observer of the run may define (any of them), in their order within a step.

    Every rank announces every event at the same point of the same step: an observer that runs a collective
    (the straggler gather, the replica check) runs it at the same steps on every rank, in attach order.
    Announcing an event reads nothing from the device: an observer reads it only on its own steps (the
    certificate on logged steps, the replica check on its check steps and before saves, the straggler check
    every log.straggler_every steps).
    """

    def step_started(self, step: int) -> None:
        """Step `step` (1-based) starts (or starts again: the in-place mode's next attempt)."""

    def step_trained(self, step: int) -> None:
        """Step `step` updated the model and the ranks polled the stop agreement."""

    def step_logged(self, record: dict[str, Any], steps: int, seconds: float) -> None:
        """A logged step's record (all ranks) before it is written, for its window of `steps` steps that took
        `seconds`: an observer may add fields of its own (throughput's) and must change none."""

    def step_ended(self, step: int) -> None:
        """After the step's logs, before its evaluation."""

    def state_settled(self, step: int, logged: bool, saving: bool) -> None:
        """After the step's evaluation, with its state final: `saving` when a checkpoint of it follows."""

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Around a part of the loop that is not a step: "evaluation" or "checkpoint"."""


class Observers:
    """The run's observers, each event announced to those that define it, in the order they were attached."""

    def __init__(self) -> None:
        self.attached: list[object] = []

    def attach(self, observer: object) -> None:
        """Add an observer (run.py, before the loop)."""
        self.attached.append(observer)

    def _announce(self, event: str, *args: Any) -> None:
        for observer in self.attached:
            fn = getattr(observer, event, None)
            if fn is not None:
                fn(*args)

    def step_started(self, step: int) -> None:
        """LoopObserver.step_started to each observer."""
        self._announce("step_started", step)

    def step_trained(self, step: int) -> None:
        """LoopObserver.step_trained to each observer."""
        self._announce("step_trained", step)

    def step_logged(self, record: dict[str, Any], steps: int, seconds: float) -> None:
        """LoopObserver.step_logged to each observer."""
        self._announce("step_logged", record, steps, seconds)

    def step_ended(self, step: int) -> None:
        """LoopObserver.step_ended to each observer."""
        self._announce("step_ended", step)

    def state_settled(self, step: int, logged: bool, saving: bool) -> None:
        """LoopObserver.state_settled to each observer."""
        self._announce("state_settled", step, logged, saving)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Every observer's LoopObserver.phase around the body."""
        with ExitStack() as stack:
            for observer in self.attached:
                fn = getattr(observer, "phase", None)
                if fn is not None:
                    stack.enter_context(fn(name))
            yield
