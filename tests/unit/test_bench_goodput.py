"""The goodput benchmark's accounting of a kill (bench/goodput.py), on metrics records written as an in-place run
writes them: the stall to the next committed step, and the replacement's time to full membership."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's bench package

from bench.ft_jobs import Kill  # noqa: E402
from bench.goodput import failure_costs  # noqa: E402


def quorum(t: float, step: int, groups: list[int], joined: list[int], left: list[int]) -> dict[str, Any]:
    return {
        "kind": "event",
        "event": "quorum",
        "time": t,
        "step": step,
        "groups": groups,
        "joined": joined,
        "left": left,
        "discarded_steps": 1 if left else 0,
    }


def train(t: float, step: int) -> dict[str, Any]:
    return {"kind": "train", "time": t, "step": step}


def test_a_replacement_that_heals_in_the_first_quorum_after_its_kill_counts_to_full_membership() -> None:
    # Group 0 killed at t=100 and started again at 100.1; the first quorum after the kill holds it (healing) and
    # group 2; group 1 joins 0.4 s later: full membership at 105.9, although no quorum says group 0 "joined".
    records = [
        quorum(10, 1, [0, 1, 2], [], []),
        train(99.8, 219),
        train(105.5, 220),
        quorum(105.5, 220, [0, 2], [], [1]),
        quorum(105.9, 221, [0, 1, 2], [1], []),
        train(105.9, 221),
        train(130.2, 300),
        quorum(130.5, 301, [1, 2], [], [0]),
        train(130.5, 301),
        quorum(134.0, 302, [0, 1, 2], [0], []),
        train(134.0, 302),
    ]
    costs = failure_costs(records, [Kill(0, 100.0, 100.1), Kill(0, 130.0, 130.05)])
    assert [round(x, 2) for x in costs["kill_to_next_step_s"]] == [5.5, 0.2]
    assert [round(x, 2) for x in costs["replacement_to_full_s"]] == [5.8, 3.95]
    assert costs["discarded_steps"] == [1, 1]
