"""The story of a run from its metrics records: attempts, what each one left behind, and where time went.

A run that crashed or was preempted is started again and resumes from a checkpoint; everything the
earlier attempt logged after that checkpoint's step was re-done and is dropped (the resumed step is
the cut). What remains is one record per step, plus the events that explain the gaps: restarts,
resumes, world-size changes, skipped steps and failed checkpoint saves, and how each attempt
ended (observe/endings.py: completed, interrupted, preempted, stopped or crashed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddptrain.observe.endings import Ending, ending_of
from ddptrain.observe.recovery import describe_recovery

_STARTS = ("start", "resume")


@dataclass(frozen=True)
class Event:
    """Something that happened to the run, at a step and a wall-clock time."""

    kind: str  # an ending (endings.ENDINGS), resume, recovery, world size, skipped steps, save failed
    step: int
    time: float
    detail: str


@dataclass
class Attempt:
    """One start of the training command (a start or resume event) and the records it wrote."""

    start: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    in_place: bool = False  # the whole in-place job: its start event is one replica group's

    @property
    def world_size(self) -> int | None:
        """World size of this attempt (from its start event, else its first train record; in the in-place mode the
        ranks of its first step, all groups together: a start event counts one group's ranks)."""
        if "world_size" in self.start and not self.in_place:
            return int(self.start["world_size"])
        train = [r for r in self.records if r["kind"] == "train"]
        return int(train[0]["world_size"]) if train and "world_size" in train[0] else None

    def reached(self) -> int:
        """The last step this attempt is known to have committed: its end record's (a crash records the step it
        had reached), else its last record's."""
        return max((int(r.get("step", 0)) for r in (self.start, *self.records)), default=0)

    def ending(self, finished: bool, last: bool) -> Ending:
        """How it ended (endings.ending_of): finished, the run reached max_steps; last, no later attempt."""
        return ending_of(self.start, self.records, finished, last)


@dataclass
class Story:
    """A run's kept records, its attempts and events, and its time accounting."""

    kept: list[dict[str, Any]]
    attempts: list[Attempt]
    events: list[Event]
    endings: list[Ending]  # one per attempt, in order
    productive_s: float  # step time of the kept train records
    redone_s: float  # step time of records dropped because a later attempt re-did those steps
    redone_steps: int


def _window_steps(train: list[dict[str, Any]], first_step: int) -> list[int]:
    """Optimizer steps each train record covers (records log a window ending at their step)."""
    out, previous = [], first_step
    for r in train:
        out.append(max(r["step"] - previous, 1))
        previous = r["step"]
    return out


def step_seconds(train: list[dict[str, Any]], first_step: int) -> float:
    """Time spent in optimizer steps by these records (one attempt's, in order)."""
    return float(sum(float(r.get("step_time_s", 0.0)) * n for r, n in zip(train, _window_steps(train, first_step))))


def split_attempts(records: list[dict[str, Any]]) -> list[Attempt]:
    """Records grouped by the start/resume event that precedes them (records before any start: attempt 0).

    In an in-place run (quorum events) every replica group writes a start or resume when it (re)joins while
    the others train on: one attempt, not a restart that re-does steps."""
    attempts: list[Attempt] = []
    in_place = any(r.get("event") == "quorum" for r in records)
    for r in records:
        if r["kind"] == "event" and r.get("event") in _STARTS and not (in_place and attempts):
            attempts.append(Attempt(start=r, in_place=in_place))
        elif attempts:
            attempts[-1].records.append(r)
        else:
            attempts.append(
                Attempt(start={"kind": "event", "event": "start", "step": 0, "time": r.get("time", 0.0)}, records=[r])
            )
    return attempts


def _when(r: dict[str, Any]) -> float:
    return float(r.get("time", 0.0))


def tell(records: list[dict[str, Any]], finished: bool) -> Story:
    """Cut abandoned records and list the events; `finished`: the last attempt reached max_steps."""
    attempts = split_attempts(records)
    kept: list[dict[str, Any]] = []
    events: list[Event] = []
    endings: list[Ending] = []
    productive_s, redone_s, redone_steps = 0.0, 0.0, 0
    for i, attempt in enumerate(attempts):
        cut = attempts[i + 1].start.get("step") if i + 1 < len(attempts) else None
        first = int(attempt.start.get("step", 0))
        train = [r for r in attempt.records if r["kind"] == "train"]
        if cut is None:
            productive_s += step_seconds(train, first)
        else:
            redone_steps += max(attempt.reached() - cut, 0)
            kept_s, lost_s = _split_seconds(train, first, cut, attempt.reached())
            productive_s, redone_s = productive_s + kept_s, redone_s + lost_s
        kept.append(attempt.start)
        kept += [r for r in attempt.records if cut is None or r["kind"] == "event" or r.get("step", 0) <= cut]
        if i > 0:
            before = attempts[i - 1].world_size
            events.append(
                Event(
                    "resume",
                    first,
                    _when(attempt.start),
                    f"attempt {i + 1} resumed from step {first} at world size {attempt.world_size}",
                )
            )
            if before is not None and attempt.world_size is not None and before != attempt.world_size:
                events.append(
                    Event("world size", first, _when(attempt.start), f"world size {before} -> {attempt.world_size}")
                )
        events += _events_of(attempt, cut)
        ending = attempt.ending(finished, last=i == len(attempts) - 1)
        endings.append(ending)
        events.append(Event(ending.kind, ending.step, ending.time, f"attempt {i + 1} {ending.detail}"))
    events.sort(key=lambda e: (e.time, e.step))
    return Story(kept, attempts, events, endings, productive_s, redone_s, redone_steps)


def _split_seconds(train: list[dict[str, Any]], first: int, cut: int, reached: int) -> tuple[float, float]:
    """(productive, re-done) step time of an attempt whose steps after `cut` (the next attempt's resume step) were
    re-done: each log window's steps on either side of the cut at its step time, and the steps it trained after
    its last logged one, up to `reached`, at that window's step time."""
    kept = redone = 0.0
    previous = first
    for r in train:
        per_step = float(r.get("step_time_s", 0.0))
        kept += per_step * max(min(r["step"], cut) - previous, 0)
        redone += per_step * max(r["step"] - max(previous, cut), 0)
        previous = max(r["step"], previous)
    unlogged = reached - max(previous, cut)
    return kept, redone + max(unlogged, 0) * (float(train[-1].get("step_time_s", 0.0)) if train else 0.0)


def _events_of(attempt: Attempt, cut: int | None) -> list[Event]:
    """The events an attempt's records tell, its ending aside."""
    out = []
    for r in attempt.records:
        event = r.get("event") if r["kind"] == "event" else None
        if event == "recovery":
            out.append(Event("recovery", r["step"], _when(r), describe_recovery(r)))
        elif event == "checkpoint_failed":
            out.append(Event("save failed", r["step"], _when(r), str(r.get("error", ""))))
        elif r["kind"] == "train" and r.get("skipped_steps") and (cut is None or r["step"] <= cut):
            out.append(
                Event(
                    "skipped steps", r["step"], _when(r), f"{r['skipped_steps']} step(s) skipped (non-finite gradient)"
                )
            )
    return out


@dataclass(frozen=True)
class Goodput:
    """Wall time from the first start to the last record, split into productive steps and losses."""

    wall_s: float
    productive_s: float
    lost: dict[str, float]  # what -> seconds

    @property
    def ratio(self) -> float:
        """Productive step time / wall time."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


def goodput(story: Story) -> Goodput:
    """Itemize the run's wall time: productive steps, re-done steps, restarts (gap from an attempt's
    last record to the next start: detection, requeue or queue wait, start-up, checkpoint load),
    checkpoint blocking, and the rest (evaluation, logging, warm-up)."""
    times = [_when(r) for a in story.attempts for r in (a.start, *a.records) if "time" in r]
    wall = max(times) - min(times) if times else 0.0
    restarts = 0.0
    for before, after in zip(story.attempts, story.attempts[1:]):
        last = max((_when(r) for r in (before.start, *before.records)), default=_when(before.start))
        restarts += max(_when(after.start) - last, 0.0)
    blocked = sum(
        float(r.get("blocked_s", 0.0)) for r in story.kept if r["kind"] == "event" and r.get("event") == "checkpoint"
    )
    lost = {"re-done steps": story.redone_s, "restarts (down time)": restarts, "checkpoint blocking": blocked}
    lost["other (eval, logging, start-up)"] = max(wall - story.productive_s - sum(lost.values()), 0.0)
    return Goodput(wall, story.productive_s, lost)
