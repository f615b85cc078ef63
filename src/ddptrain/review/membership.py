"""Quorum changes, heals and committed-step goodput of an in-place fault-tolerant run, for `ddptrain report`.

The in-place mode (train/sync/in_place.py) writes a `quorum` event on every change of the replica
groups taking part ({"groups", "joined", "left", "world_size", "discarded_steps"}) and a `heal` event
per state a joining group received ({"replica_group", "seconds", "bytes", "bytes_per_s", "verified"}).
`membership_report` turns them into summary lines and membership.png (world size over the steps, joins,
leaves and heals marked), and says nothing for a run without them.

Goodput here counts committed steps, so that it reads the same in both fault-tolerance modes (the
goodput benchmark, bench/goodput.py, uses it): the steps committed after the window's first one, times
the fault-free step time (the median interval between consecutive steps: faults are rare, so the median
is a fault-free step; with DiLoCo the median time per step between consecutive outer syncs, which charges each
step its share of a sync), over the window's wall time. Steps re-done after a restart count once.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ddptrain.safe_files import replacing  # noqa: E402


@dataclass(frozen=True)
class StepGoodput:
    """Committed progress over a window of wall time."""

    steps: int  # distinct steps committed after the window's first step
    step_s: float  # median interval between consecutive steps: the fault-free step time
    wall_s: float  # from the window's first step to its end

    @property
    def ratio(self) -> float:
        """Productive step time over wall time (0 when the window is empty)."""
        return self.steps * self.step_s / self.wall_s if self.wall_s > 0 else 0.0


def step_goodput(records: list[dict[str, Any]], end: float | None = None) -> StepGoodput | None:
    """Goodput of the train records up to `end` (default: the last one); None with fewer than two steps."""
    train = [r for r in records if r.get("kind") == "train" and (end is None or r["time"] <= end)]
    if len(train) < 2:
        return None
    intervals = sync_intervals(train) or [
        b["time"] - a["time"] for a, b in zip(train, train[1:]) if b["step"] == a["step"] + 1
    ]
    if not intervals:
        return None
    stop = train[-1]["time"] if end is None else end
    steps = max(r["step"] for r in train) - train[0]["step"]
    return StepGoodput(steps, statistics.median(intervals), stop - train[0]["time"])


def sync_intervals(train: list[dict[str, Any]]) -> list[float]:
    """DiLoCo (records with `outer_syncs`): seconds per step over each stretch between two consecutive logged outer
    syncs, so that every step carries its share of a sync (the interval between two inner steps leaves it out).
    Empty for a run without outer syncs."""
    syncs = [b for a, b in zip(train, train[1:]) if b.get("outer_syncs", 0) > a.get("outer_syncs", 0)]
    return [
        (b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(syncs, syncs[1:]) if b["step"] > a["step"]
    ]


def _events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "event" and r.get("event") == name]


def membership_lines(records: list[dict[str, Any]]) -> list[str]:
    """Summary lines: the groups over time, quorum changes, discarded steps, heals and the goodput."""
    quorums, heals = _events(records, "quorum"), _events(records, "heal")
    left = sum(len(q["left"]) for q in quorums)
    joined = sum(len(q["joined"]) for q in quorums)
    sizes = " -> ".join(str(q["world_size"]) for q in quorums)
    lines = [
        f"in-place quorum: {len(quorums)} change(s) ({left} group(s) left, {joined} joined), "
        f"{sum(q['discarded_steps'] for q in quorums)} step(s) discarded; world size {sizes}"
    ]
    verified = [h for h in heals if h["verified"]]
    if heals:
        seconds = statistics.median(h["seconds"] for h in verified) if verified else float("nan")
        rate = [h["bytes_per_s"] for h in verified if h.get("bytes_per_s")]
        speed = f", {statistics.median(rate) / 1e6:,.1f} MB/s" if rate else ""
        lines.append(
            f"heals: {len(verified)} verified (median {seconds:.3f} s{speed}), {len(heals) - len(verified)} refused"
        )
    g = step_goodput(records)
    if g is not None:
        lines.append(
            f"goodput (committed steps): {100 * g.ratio:.1f}% ({g.steps} steps x {g.step_s:.3f} s median step "
            f"in {g.wall_s:,.1f} s)"
        )
    return lines


def plot_membership(records: list[dict[str, Any]], path: Path) -> Path:
    """membership.png: ranks taking part per step, groups joining and leaving, heals."""
    train = [r for r in records if r.get("kind") == "train" and "world_size" in r]
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=100)
    ax.step([r["step"] for r in train], [r["world_size"] for r in train], where="post", color="black", label="ranks")
    for q in _events(records, "quorum"):
        for kind, marker, colour in (("left", "v", "tab:red"), ("joined", "^", "tab:green")):
            if q[kind]:
                ax.plot(q["step"], q["world_size"], marker, color=colour, label=f"group(s) {kind}")
                ax.annotate(",".join(map(str, q[kind])), (q["step"], q["world_size"]), fontsize=7, color=colour)
    for h in _events(records, "heal"):
        ax.axvline(h["step"], color="tab:blue" if h["verified"] else "tab:orange", linestyle=":", alpha=0.8)
    g = step_goodput(records)
    title = "in-place membership" + (f" - goodput {100 * g.ratio:.1f}%" if g else "")
    ax.set_title(title + " (dotted: heals; orange: refused)", fontsize=11)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("ranks in the step")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="lower left")
    fig.tight_layout()
    with replacing(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return path


def membership_report(records: list[dict[str, Any]], out: Path) -> tuple[str, list[Path]]:
    """For a run with quorum events: ("\\n" + summary lines, [membership.png]); otherwise ("", [])."""
    if not _events(records, "quorum"):
        return "", []
    return "\n" + "\n".join(membership_lines(records)), [plot_membership(records, out / "membership.png")]
