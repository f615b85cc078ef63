"""The recovery timeline's bookkeeping: the agent's marks through the environment, phases in order."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.observe.recovery import (
    AGENT_MARKS_ENV,
    RecoveryTimeline,
    describe_recovery,
    encode_agent_marks,
    process_start_time,
)


def test_process_start_time_is_this_process_start() -> None:
    started = process_start_time()
    assert started is not None
    # pytest started this process before the test; not in the future, not before the machine booted.
    assert started <= time.time()
    with open("/proc/uptime") as f:
        assert started >= time.time() - float(f.read().split()[0]) - 1


def test_restart_with_agent_marks_writes_every_phase_in_order(monkeypatch: Any) -> None:
    t = 1000.0
    agent = {"failure_seen": t, "workers_stopped": t + 1, "rendezvous_done": t + 3, "workers_spawned": t + 3.5}
    monkeypatch.setenv(AGENT_MARKS_ENV, encode_agent_marks(agent))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    timeline = RecoveryTimeline.from_environment()
    assert timeline.active and timeline.waiting
    timeline.marks["process_started"] = t + 3.6  # this test's process started long ago
    for i, mark in enumerate(("imports_done", "process_group_ready", "checkpoint_loaded")):
        timeline.marks[mark] = t + 5 + i
    written: list[dict[str, Any]] = []
    timeline.first_step(7, torch.tensor(1.0), lambda kind, **fields: written.append({"kind": kind, **fields}))
    assert not timeline.waiting
    (event,) = written
    assert event["event"] == "recovery" and event["step"] == 7 and event["restart_count"] == 2
    names = [n for n, _ in event["phases"]]
    assert names == ["stop", "rendezvous", "spawn", "exec", "import", "process group", "build+load", "first step"]
    assert [s for _, s in event["phases"][:6]] == [1.0, 2.0, 0.5, 0.1, 1.4, 1.0]
    assert event["since"] == "failure_seen" and event["total_s"] == round(timeline.marks["first_step_done"] - t, 3)
    assert describe_recovery(event).startswith(
        f"{event['total_s']:.2f} s from failure_seen to the first step: stop 1.00"
    )


def test_first_start_has_no_timeline(monkeypatch: Any) -> None:
    monkeypatch.delenv(AGENT_MARKS_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not RecoveryTimeline.from_environment().waiting


ENV_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=80)
MARK_NAMES = st.sampled_from(["failure_seen", "rendezvous_done", "bogus", ""])
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), ENV_TEXT, st.lists(st.integers()))


@settings(max_examples=50)
@given(st.one_of(ENV_TEXT, st.dictionaries(MARK_NAMES, JSON_VALUES).map(json.dumps), JSON_VALUES.map(json.dumps)))
def test_malformed_agent_marks_are_ignored(raw: str) -> None:
    os.environ[AGENT_MARKS_ENV] = raw
    try:
        timeline = RecoveryTimeline.from_environment()
    finally:
        del os.environ[AGENT_MARKS_ENV]
    assert set(timeline.marks) <= {
        "failure_seen",
        "workers_stopped",
        "rendezvous_done",
        "workers_spawned",
        "process_started",
    }
    assert all(isinstance(v, float) for v in timeline.marks.values())
