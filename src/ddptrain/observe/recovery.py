"""Where the seconds of a restart go: failure seen -> next training step, split into phases.

The launcher's agent (ddptrain launch) marks what it sees and does: the failure, the old workers
stopped, the rendezvous done, the new workers being spawned. It hands those marks to the new
workers in an environment variable. Each worker adds its own marks: its process start (from the
kernel, so the interpreter's start-up is included), imports done, process group ready, checkpoint
loaded, first step done. Rank 0 writes them as one `recovery` event to metrics.jsonl, and
`ddptrain report` prints the phases.

All marks are wall-clock times (time.time()) taken on the same host as the rank that writes them,
so the differences are meaningful without synchronised clocks. Under plain torchrun there are no
agent marks and the timeline starts at the worker's process start.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

AGENT_MARKS_ENV = "DDPTRAIN_RECOVERY_MARKS"

# Marks in the order they happen; each phase is named by the mark that ends it.
AGENT_MARKS = ("failure_seen", "workers_stopped", "rendezvous_done", "workers_spawned")
WORKER_MARKS = ("process_started", "imports_done", "process_group_ready", "checkpoint_loaded", "first_step_done")
PHASES = {
    "workers_stopped": "stop",
    "rendezvous_done": "rendezvous",
    "workers_spawned": "spawn",
    "process_started": "exec",
    "imports_done": "import",
    "process_group_ready": "process group",
    "checkpoint_loaded": "build+load",
    "first_step_done": "first step",
}


def encode_agent_marks(marks: Mapping[str, float]) -> str:
    """The agent's marks as the value of AGENT_MARKS_ENV."""
    return json.dumps({k: round(v, 4) for k, v in marks.items() if k in AGENT_MARKS})


def _agent_marks(raw: str | None) -> dict[str, float]:
    """The agent's marks from AGENT_MARKS_ENV; anything malformed is ignored (it is only a measurement)."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    marks = {}
    for k, v in value.items():
        if k in AGENT_MARKS and isinstance(v, int | float) and not isinstance(v, bool) and abs(v) < 1e12:
            marks[k] = float(v)
    return marks


def process_start_time() -> float | None:
    """When this process was created (wall clock, 10 ms resolution, from /proc), or None off Linux."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # Field 22 of stat (starttime: clock ticks since boot) is the 20th after the ")" of the name.
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, IndexError, ValueError, AttributeError):
        return None


class RecoveryTimeline:
    """The marks of one (re)start of this process; writes the `recovery` event after the first step.

    Active only for a restart (TORCHELASTIC_RESTART_COUNT > 0 or agent marks present): a first
    start has nothing to recover from.
    """

    def __init__(self, restart_count: int, agent_marks: Mapping[str, float], started: float | None) -> None:
        self.restart_count = restart_count
        self.active = restart_count > 0 or bool(agent_marks)
        self.marks: dict[str, float] = dict(agent_marks)
        if started is not None:
            self.marks["process_started"] = started

    @classmethod
    def from_environment(cls) -> RecoveryTimeline:
        """This process's timeline: the agent's marks and restart count from the environment, its start time."""
        raw_count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        restarts = int(raw_count) if raw_count.isdigit() else 0
        return cls(restarts, _agent_marks(os.environ.get(AGENT_MARKS_ENV)), process_start_time())

    def mark(self, name: str) -> None:
        """Record that `name` (one of WORKER_MARKS) happened now."""
        self.marks[name] = time.time()

    @property
    def waiting(self) -> bool:
        """True until the first step of an active timeline is marked."""
        return self.active and "first_step_done" not in self.marks

    def first_step(self, step: int, loss: torch.Tensor, write: Callable[..., None]) -> None:
        """Mark the first step done and write the event. Reads the loss once (a host sync, once per
        restart) so that the mark is when the step finished, not when its kernels were queued."""
        loss.item()
        self.mark("first_step_done")
        write("event", event="recovery", step=step, restart_count=self.restart_count, **self.phases())

    def phases(self) -> dict[str, Any]:
        """{"phases": [[name, seconds], ...], "total_s": seconds} over the marks present, in order."""
        order = [m for m in (*AGENT_MARKS, *WORKER_MARKS) if m in self.marks]
        phases = [[PHASES[b], round(self.marks[b] - self.marks[a], 3)] for a, b in zip(order, order[1:], strict=False)]
        total = self.marks[order[-1]] - self.marks[order[0]] if order else 0.0
        return {"phases": phases, "since": order[0] if order else None, "total_s": round(total, 3)}


def describe_recovery(event: Mapping[str, Any]) -> str:
    """One line for a `recovery` event: total and phases, e.g. "9.1 s from failure_seen: stop 1.0, ..."."""
    parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in event.get("phases", []))
    return f"{float(event.get('total_s', 0.0)):.2f} s from {event.get('since')} to the first step: {parts}"
