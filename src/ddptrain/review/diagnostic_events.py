"""Stragglers, slow communication and hangs as events on the report's plots (vertical lines) and in its summary.

Kept apart from report.py so the report can change shape without touching how these events are read:
`diagnostic_events(records)` reads them from metrics.jsonl records, `draw_diagnostic_events(ax, events)`
marks them on a matplotlib axis, `summarize_diagnostic_events(events)` gives the summary's lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_STYLE = {"straggler": ("tab:orange", "--"), "slow communication": ("tab:purple", "-."), "hang": ("tab:red", "-")}


@dataclass(frozen=True)
class DiagnosticEvent:
    """Something the run's own checks flagged, at a step."""

    step: int
    kind: str  # "straggler", "slow communication", "hang"
    label: str


def diagnostic_events(records: list[dict[str, Any]]) -> list[DiagnosticEvent]:
    """The first check of every straggler / slow-communication episode, and every hang, in step order."""
    events: list[DiagnosticEvent] = []
    previous: set[Any] = set()
    for r in records:
        if r.get("kind") == "ranks":
            now: set[Any] = set()
            if "straggler_rank" in r:
                now.add(("straggler", r["straggler_rank"]))
                if ("straggler", r["straggler_rank"]) not in previous:
                    events.append(
                        DiagnosticEvent(
                            r["step"],
                            "straggler",
                            f"rank {r['straggler_rank']} on {r.get('straggler_host', '?')} ({r.get('ratio', 0):.2f}x)",
                        )
                    )
            if "slow_comm_ratio" in r:
                now.add(("comm",))
                if ("comm",) not in previous:
                    label = f"{r['slow_comm_ratio']:.1f}x baseline"
                    events.append(DiagnosticEvent(r["step"], "slow communication", label))
            previous = now
        elif r.get("kind") == "event" and r.get("event") == "hang":
            events.append(
                DiagnosticEvent(
                    r["step"],
                    "hang",
                    f"rank {r.get('rank', '?')} saw no progress for "
                    f"{r.get('waited_s', 0):.1f} s ({r.get('phase', '?')})",
                )
            )
    return sorted(events, key=lambda e: e.step)


def draw_diagnostic_events(ax: Any, events: list[DiagnosticEvent]) -> None:
    """Vertical lines at the events' steps, one legend entry per kind."""
    shown: set[str] = set()
    for e in events:
        color, style = _STYLE[e.kind]
        ax.axvline(e.step, color=color, linestyle=style, alpha=0.8, label=None if e.kind in shown else e.kind)
        shown.add(e.kind)


def summarize_diagnostic_events(events: list[DiagnosticEvent]) -> list[str]:
    """Summary lines: hangs first (the run stopped there), then straggler and communication episodes."""
    lines = []
    for kind in ("hang", "straggler", "slow communication"):
        of_kind = [e for e in events if e.kind == kind]
        if of_kind:
            shown = "; ".join(f"step {e.step}: {e.label}" for e in of_kind[:5])
            more = f" and {len(of_kind) - 5} more" if len(of_kind) > 5 else ""
            lines.append(f"{kind} episodes: {len(of_kind)} ({shown}{more})")
    return lines
