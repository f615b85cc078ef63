"""`python -m bench.ft_session_timer OUT.json ddptrain-args...`: `ddptrain train` with the in-place session's calls timed.

Wraps the calls the in-place mode adds to a step (train/in_place.py's InPlaceSession: the quorum, the
small sum over all ranks, the commit vote; train/cross_group.py: the wait for the cross-group gradient
sums after backward) with a wall-clock timer and
writes every call's seconds, in order, to OUT.json when training ends. The source is not changed:
this only runs it.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddptrain.train.cross_group import CrossGroupGradients
from ddptrain.train.in_place import InPlaceSession

# What each timed call is called in the figures, and where it is.
CALLS = {
    "quorum": (InPlaceSession, "quorum"),
    "gradient sum wait": (CrossGroupGradients, "finish"),  # after backward: the buckets' sums not done yet
    "sum_over_all_ranks": (InPlaceSession, "sum_over_all_ranks"),
    "should_commit": (InPlaceSession, "should_commit"),
}


def timed(seconds: dict[str, list[float]], name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    """call, appending each call's wall time to seconds[name]."""

    @functools.wraps(call)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds[name].append(time.perf_counter() - t0)

    return wrapper


def main(argv: list[str]) -> int:
    """Train with the session's calls timed; write their seconds to argv[0]."""
    from ddptrain.cli import main as ddptrain

    out, args = Path(argv[0]), argv[1:]
    seconds: dict[str, list[float]] = {name: [] for name in CALLS}
    for name, (owner, method) in CALLS.items():
        setattr(owner, method, timed(seconds, name, getattr(owner, method)))
    try:
        return ddptrain(["train", *args]) or 0
    finally:
        out.write_text(json.dumps(seconds))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
