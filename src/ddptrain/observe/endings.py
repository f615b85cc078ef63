"""How an attempt of a run ended: the record written at its end, and how the report and the trackers read it.

An attempt is one start of the training command. It ends in one of six ways:

    completed    it reached train.max_steps (exit 0)
    finished_early  a decided end before max_steps with a committed checkpoint: train.early_stop, or a
                 hook of the Python API asked (train/hooks.py) (exit 0; the record's reason says which)
    interrupted  Ctrl-C: every rank stopped at one step and committed a checkpoint (exit 130); a
                 second Ctrl-C quits at once, without a checkpoint (still 130, `checkpoint: false`)
    preempted    SIGTERM or SIGUSR1: every rank stopped at one step and committed a checkpoint (exit 75);
                 a Ctrl-C after it quits at once (still 75: the first stop signal decides)
    stopped      a decided stop of every rank: a non-finite gradient under train.on_nonfinite=stop, a
                 failed save under ckpt.on_error=stop (exit 1), bad input met while training (exit 2)
    crashed      an error ended it (exit 1; the record names the error), or it left no end record at
                 all: killed (SIGKILL, the out-of-memory killer), power lost, its node lost, or its
                 lease taken by another run (exit 73: it writes nothing more into the folder)

`Run.fit` writes the end record into metrics.jsonl: an "event" record named after the ending, with the
step, the exit code and what caused it. Older versions wrote one only for a preemption, an
interruption or a stop; their other attempts are read as completed (the run reached max_steps) or
crashed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENDINGS = ("completed", "finished_early", "interrupted", "preempted", "stopped", "crashed")
# The exit code each ending means when its record does not say (records of older versions).
EXIT_CODES = {"completed": 0, "finished_early": 0, "interrupted": 130, "preempted": 75, "stopped": 1, "crashed": 1}
NO_RECORD = "killed (SIGKILL, out of memory), power lost or node lost?"


@dataclass(frozen=True)
class Ending:
    """How one attempt ended; `recorded` is False for a crash that left no end record."""

    kind: str
    step: int
    time: float
    exit_code: int | None  # None: nothing recorded it
    recorded: bool
    detail: str


def end_record(kind: str, step: int, exit_code: int, **detail: Any) -> dict[str, Any]:
    """The fields of the end record Run.fit writes (`metrics.write("event", **end_record(...))`)."""
    if kind not in ENDINGS:
        raise ValueError(f"unknown ending {kind!r}")
    return {"event": kind, "step": step, "exit_code": exit_code, **detail}


def is_end_record(record: dict[str, Any]) -> bool:
    """True for an attempt's end record."""
    return record.get("kind") == "event" and record.get("event") in ENDINGS


def describe(record: dict[str, Any]) -> str:
    """One line for an end record, e.g. 'preempted by SIGTERM at step 8, checkpoint committed (exit 75)'."""
    kind, step = str(record["event"]), record.get("step", "?")
    code = record.get("exit_code", EXIT_CODES[kind])
    if kind == "completed":
        what = f"completed at step {step}"
    elif kind == "finished_early":
        what = f"finished early at step {step}: {record.get('reason') or 'no reason recorded'}"
    elif kind in ("interrupted", "preempted"):
        by = "Ctrl-C" if kind == "interrupted" else "a stop signal"
        signal = record.get("signal") or f"{by} on another rank"
        saved = "checkpoint committed" if record.get("checkpoint", True) else "quit at once, no checkpoint"
        what = f"{kind} by {signal} at step {step}, {saved}"
    else:
        why = record.get("reason") or record.get("error") or "no reason recorded"
        what = f"{kind} at step {step}: {why}"
    return f"{what} (exit {code})"


def ending_of(start: dict[str, Any], records: list[dict[str, Any]], finished: bool, last: bool) -> Ending:
    """How the attempt that began with `start` and wrote `records` ended.

    finished: the run reached train.max_steps; for the last attempt of a version that wrote no
    completed record, that means it completed. last: no later attempt exists (no record may only
    mean it is still running).
    """
    ends = [r for r in records if is_end_record(r)]
    if ends:
        r = ends[-1]
        code = int(r.get("exit_code", EXIT_CODES[r["event"]]))
        return Ending(str(r["event"]), int(r.get("step", 0)), float(r.get("time", 0.0)), code, True, describe(r))
    final = records[-1] if records else start
    step, when = int(final.get("step", start.get("step", 0))), float(final.get("time", 0.0))
    if last and finished:
        return Ending("completed", step, when, 0, False, f"completed at step {step}")
    how = f"last record at step {step}" if records else "no records after its start"
    detail = f"ended without an end record ({how}): {NO_RECORD}" + ("; or still running" if last else "")
    return Ending("crashed", step, when, None, False, detail)
