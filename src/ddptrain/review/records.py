"""Reading metrics.jsonl for `ddptrain report`: every record the report, its story and its plots read is type-checked.

The file may be damaged (a disk error, a hand edit, a concurrent writer): a record whose fields
have the wrong type is refused with its line number before anything reads it, so the report never
ends in a traceback. Only a last line that is not JSON at all is tolerated (the run died while
writing it); anything else malformed is bad input (exit 2, one line naming the line and the field),
as a report built on silently skipped records would misstate steps, throughput and goodput.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddptrain.errors import DataError
from ddptrain.safe_files import read_regular_file

PHASES = ("data_wait_s", "forward_s", "backward_s", "optimizer_s")


def is_number(value: Any) -> bool:
    """An int or float (JSON number), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_phases(value: Any) -> bool:
    """A recovery event's phases: [[name, seconds], ...]."""
    return isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and is_number(p[1]) for p in value
    )


def _is_time(value: Any) -> bool:
    """A Unix time the summary can print as a date (finite, from 1970 to the year 5138)."""
    return is_number(value) and 0 <= value < 1e11


_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "time": ("a Unix time", _is_time),
    "int": ("an integer", _is_int),
    "number": ("a number", is_number),
    "value": ("a number or text", lambda v: is_number(v) or isinstance(v, str)),  # non-finite values are text
    "numbers": ("a list of numbers", lambda v: isinstance(v, list) and all(map(is_number, v))),
    "ints": ("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v))),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "number or null": ("a number or null", lambda v: v is None or is_number(v)),
    "text": ("text", lambda v: isinstance(v, str)),
    "phases": ("a list of [name, seconds] pairs", _is_phases),
}

# The fields the summary, the story and the plots read, per record kind: required ones, then ones
# checked wherever present. Fields of every kind: "time" and "step" (numbers), "world_size".
_REQUIRED = {
    "train": {"step": "int", "loss": "value", "step_time_s": "number", "samples_per_s": "number"},
    "eval": {"step": "int", "val_loss": "value"},
    "ranks": {"step": "int", "local_step_s": "numbers"},
    "event": {"event": "text", "step": "int"},
}
# The in-place mode's events (review/membership.py, review/groups.py read every field).
_REQUIRED_EVENTS = {
    "quorum": {
        **dict.fromkeys(("groups", "joined", "left"), "ints"),
        **dict.fromkeys(("world_size", "discarded_steps"), "int"),
    },
    "heal": {"replica_group": "int", "seconds": "number", "verified": "bool"},
}
_ANY_KIND = {"time": "time", "step": "int", "world_size": "int"}
_OPTIONAL = {
    "train": {
        **dict.fromkeys(("tokens_per_s", "mfu", "flops_per_s_per_device", "peak_mem_mb", "exposed_comm_s"), "number"),
        **dict.fromkeys(PHASES, "number"),
        "skipped_steps": "int",
    },
    "ranks": {"straggler_rank": "int", "ratio": "number", "slow_comm_ratio": "number"},
    "event": {
        **dict.fromkeys(("blocked_s", "total_s", "waited_s"), "number"),
        "exit_code": "int",
        "phases": "phases",
        **dict.fromkeys(("replica_group", "restart_count"), "int"),  # in-place (review/groups.py)
        "bytes_per_s": "number or null",
    },
}


def check_record(record: Any) -> None:
    """ValueError naming the first missing or mistyped field of a metrics record that the report reads."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        raise ValueError("not a metrics record (a JSON object with a text 'kind')")
    kind = record["kind"]
    required = _REQUIRED.get(kind, {}) | (_REQUIRED_EVENTS.get(str(record.get("event")), {}) if kind == "event" else {})
    for key, check in required.items():
        what, ok = _CHECKS[check]
        if not ok(record.get(key)):
            raise ValueError(f"a {kind!r} record without a valid {key!r}: not {what} (got {record.get(key)!r:.80})")
    for key, check in {**_ANY_KIND, **_OPTIONAL.get(kind, {})}.items():
        what, ok = _CHECKS[check]
        if key in record and not ok(record[key]):
            raise ValueError(f"a {kind!r} record whose {key!r} is not {what} (got {record[key]!r:.80})")


def read_records(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(records, last line was cut off). DataError when missing, empty, or malformed anywhere but a cut-off end."""
    try:
        data = read_regular_file(path, follow=True)  # a FIFO named metrics.jsonl is refused, not waited on
    except OSError as e:
        missing = isinstance(e, FileNotFoundError)
        why = "is this a run folder (run.dir)?" if missing else f"{e.strerror or e}"
        raise DataError(f"no metrics file at {path}: {why}") from None
    lines = data.decode("utf-8", errors="replace").splitlines()
    records, truncated = [], False
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:  # RecursionError: brackets nested thousands deep
            if i == len(lines):  # the run died while writing its last line
                truncated = True
                break
            raise DataError(f"{path} line {i} is malformed ({e}); only a cut-off last line is tolerated") from None
        try:
            check_record(record)
        except ValueError as e:
            raise DataError(f"{path} line {i} is malformed ({e}); only a cut-off last line is tolerated") from None
        records.append(record)
    if not any(r["kind"] == "train" for r in records):
        what = "is empty" if not records else "has no training records yet"
        raise DataError(f"{path} {what}: nothing to report (training logs every log.every_steps steps)")
    return records, truncated
