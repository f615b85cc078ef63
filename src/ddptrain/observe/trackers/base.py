"""The tiny interface every experiment tracker implements, and what records become in a tracker.

A tracker receives, from one background thread (never the training thread):
    open(run_id, start)   create the run, or continue the one stored in run.dir/trackers.json
    send(update)          metric points (key, value, step, time), tags and labels
    upload(folder, kind)  a folder of files at the end of the run (the report's PNGs, the exported model)
    finish(status)        how the attempt ended: completed, interrupted, preempted, stopped, crashed
                          (observe/endings.py), or failed (it never started training)
Anything may raise: the delivery thread (background.py) retries and never lets it reach training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ddptrain.observe.endings import ENDINGS, NO_RECORD, describe

# Events that describe the run's life rather than a measurement: they become tags, not metrics
# (a resume's step lies behind steps the tracker already holds, and metric steps never go back).
LIFECYCLE_EVENTS = ("start", "resume", *ENDINGS)


class Point(NamedTuple):
    """One metric value at one step."""

    key: str
    value: float
    step: int
    time: float  # seconds since the epoch, when it was measured


@dataclass
class StartInfo:
    """What a tracker run is opened with: the resolved config and the system it runs on."""

    run_name: str
    params: dict[str, Any]  # the flattened resolved config, "train.lr" -> 0.003
    system: dict[str, str]  # world size, devices, versions, git commit (sent as tags)
    attempt: int  # 1 on the first start of the run folder
    crashed_attempt: int | None = None  # the previous attempt, when it ended without closing its trackers


@dataclass
class Update:
    """One delivery: metric points in step order, tags (key -> text) and labels (short words)."""

    points: list[Point] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)
    delivered: dict[str, int] = field(default_factory=dict)  # high-water marks after this update

    def __bool__(self) -> bool:
        return bool(self.points or self.tags or self.labels)


@dataclass
class Opened:
    """An open tracker run: its id and the highest steps it already holds per record kind."""

    run_id: str
    delivered: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # warnings for the user (e.g. runs an older version left open)


class Tracker(Protocol):
    """One experiment tracker (MLflow, W&B, ...); called from one delivery thread only."""

    name: str  # "mlflow", "wandb": the key in trackers.json and in messages

    def open(self, run_id: str | None, start: StartInfo) -> Opened:
        """Create a run (run_id None) or continue run_id; send params and system tags."""

    def send(self, update: Update) -> None:
        """Deliver metric points, tags and labels (all or nothing, as far as the tracker allows)."""

    def upload(self, folder: Path, kind: str) -> None:
        """Attach a folder's files to the run; kind is "report" or "model"."""

    def finish(self, status: str) -> None:
        """Mark the run with how the attempt ended (see the module docstring) and release the tracker's resources."""


class Sink(Protocol):
    """What MetricsWriter feeds besides metrics.jsonl (TensorBoard, a BackgroundTracker)."""

    name: str

    def write(self, record: dict[str, Any]) -> None:
        """Take one metrics record without holding up training."""

    def upload(self, folder: Path, kind: str) -> None:
        """Attach a folder of files (the report, the exported model) to the run."""

    def close(self, status: str) -> None:
        """Flush (bounded in time) and release; status is how the attempt ended (see the module docstring)."""


def record_series(record: dict[str, Any]) -> str | None:
    """The series a record's metrics belong to ("train", "eval", "ranks", "event/checkpoint"), None for lifecycle."""
    kind = str(record.get("kind", ""))
    if kind != "event":
        return kind
    event = record.get("event", "")
    return None if event in LIFECYCLE_EVENTS else f"event/{event}"


def record_points(record: dict[str, Any], series: str) -> list[Point]:
    """Numeric fields of a record as points "<series>/<field>"; per-rank lists as ".../rank<i>"."""
    step, when = int(record["step"]), float(record.get("time", 0.0))
    points = []
    for key, value in record.items():
        if key in ("kind", "event", "step", "time"):
            continue
        if _is_number(value):
            points.append(Point(f"{series}/{key}", float(value), step, when))
        elif isinstance(value, list) and value and all(map(_is_number, value)):
            points.extend(Point(f"{series}/{key}/rank{i}", float(v), step, when) for i, v in enumerate(value))
    return points


def lifecycle_tags(
    record: dict[str, Any], start: StartInfo, previous_world_size: int | None
) -> tuple[dict[str, str], list[str]]:
    """Tags and labels for a start, resume or an attempt's end (keys carry the attempt number)."""
    event, step, attempt = record.get("event"), record.get("step"), start.attempt
    if event in ("start", "resume"):
        ws = record.get("world_size")
        tags = {
            "ddptrain.status": "running",
            "ddptrain.attempts": str(attempt),
            "ddptrain.world_size": str(ws),
            f"ddptrain.attempt.{attempt}": (
                f"{event} at step {step}, world size {ws}, restart count {record.get('restart_count', 0)}, "
                f"host {record.get('host', '?')}"
            ),
        }
        labels = ["resumed"] if attempt > 1 else []
        if previous_world_size is not None and ws != previous_world_size:
            tags[f"ddptrain.world_size_change.{attempt}"] = f"{previous_world_size} -> {ws} at step {step}"
            labels.append("world-size-changed")
        if start.crashed_attempt is not None:
            tags[f"ddptrain.ending.{start.crashed_attempt}"] = f"crashed: no end record ({NO_RECORD})"
            labels.append("crashed")
        return tags, labels
    if event not in ENDINGS:
        return {}, []
    tags = {"ddptrain.status": str(event), f"ddptrain.ending.{attempt}": describe(record)[:500]}
    if event == "preempted":  # the tags of earlier versions, kept for dashboards that read them
        tags[f"ddptrain.preempted.{attempt}"] = f"step {step} ({record.get('signal') or 'signal on another rank'})"
    elif event == "stopped":
        tags[f"ddptrain.stopped.{attempt}"] = f"step {step}: {record.get('reason', '')}"[:500]
    return tags, [str(event)] if event in ("interrupted", "preempted", "stopped", "crashed") else []


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.003}} -> {"train.lr": 0.003}; an empty section stays as {}."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
