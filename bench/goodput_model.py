"""Project both fault-tolerance modes' goodput to 1k and 16k GPUs from per-phase costs and failure rates.

python -m bench.goodput_model bench/results/<date>.json   # per-phase costs measured by `python -m bench goodput`

A failure every MTTF seconds of wall time costs the whole job C seconds of progress, so goodput =
MTTF / (MTTF + C) (checkpoint saves, the same in both modes, left out). Per failure:
- restart mode: C = restart (kill -> the next committed step: failure seen, workers stopped, rendezvous,
  processes started, imports, process group, checkpoint loaded, first step) + the re-done steps, on
  average half a checkpoint interval: ckpt_every / 2 x step;
- in place: C = stall (kill -> the next committed step: the dead group's heartbeat times out, the step in
  flight is discarded and done again) + the lost group's share of the job until its replacement trains
  again: replacement / groups (the global batch is constant: with one group of G out a step takes G/(G-1)).
The measured column uses the costs measured here (3 hosts, a kill every N s); the projections put the
published failure rates beside assumed costs at scale (named in ASSUMED: none of them is measured here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOUR = 3600.0
# Published failure rates: arXiv 2410.21680 (mean time to failure of a job on 1k and 16k GPUs) and
# Llama 3 (419 unexpected interruptions in 54 days of a 16k-GPU job).
SCALES = [
    ("1k GPUs (MTTF 8 h, arXiv 2410.21680)", 1024, 8.0 * HOUR),
    ("16k GPUs (MTTF 1.8 h, arXiv 2410.21680)", 16384, 1.8 * HOUR),
    ("16k GPUs (Llama 3: 419 in 54 days)", 16384, 54 * 24 * HOUR / 419),
]
# Assumed costs at scale (not measured here): a step of a large model, ddptrain's default checkpoint
# interval, a job restart on thousands of ranks (scheduler, containers, imports, collective init at that
# many ranks, checkpoint load), the in-place stall (torchft's default heartbeat timeout) and a spare
# node's start plus its heal from a live peer.
ASSUMED = {
    "step_s": 5.0,
    "ckpt_every": 100,
    "restart_s": 600.0,
    "stall_s": 10.0,  # torchft's default 5 s heartbeat timeout + the discarded 5 s step
    "replacement_s": 300.0,
    "gpus_per_group": 8,
}


@dataclass(frozen=True)
class Costs:
    """Per-failure costs of both modes."""

    step_s: float
    ckpt_every: int
    restart_s: float
    stall_s: float
    replacement_s: float

    def restart_cost(self) -> float:
        """Seconds of progress one failure costs the restart mode."""
        return self.restart_s + self.ckpt_every / 2 * self.step_s

    def in_place_cost(self, groups: int) -> float:
        """Seconds of progress one failure costs the in-place mode at `groups` replica groups."""
        return self.stall_s + self.replacement_s / groups


def goodput(mttf_s: float, cost_s: float) -> float:
    """Fraction of wall time that is progress when each failure, every mttf_s, costs cost_s."""
    return mttf_s / (mttf_s + cost_s)


def measured_costs(result: dict[str, Any]) -> tuple[Costs, dict[str, float]]:
    """Per-phase costs from `python -m bench goodput`'s JSON, and what it measured (goodput, schedule)."""
    modes = result["figures"]["goodput"]["modes"]
    restart, in_place = modes["restart"], modes["in-place"]
    kills = in_place["kills"]
    every = statistics.median(b["time"] - a["time"] for a, b in zip(kills, kills[1:]))
    costs = Costs(
        step_s=restart["step_s"],
        ckpt_every=int(next(a.split("=")[1] for a in result["figures"]["goodput"]["job"] if "ckpt.every" in a)),
        restart_s=statistics.median(restart["kill_to_next_step_s"]),
        stall_s=statistics.median(in_place["kill_to_next_step_s"]),
        replacement_s=statistics.median(in_place["replacement_to_full_s"]),
    )
    return costs, {"every_s": every, "restart": restart["goodput"], "in-place": in_place["goodput"]}


def restart_phases(result: dict[str, Any]) -> dict[str, float]:
    """Median seconds of each phase of the restart mode's recoveries (observe/recovery.py's timeline)."""
    phases = result["figures"]["goodput"]["modes"]["restart"]["recovery_phases"]
    names = [name for name, _ in phases[0]] if phases else []
    return {n: round(statistics.median(dict(p).get(n, 0.0) for p in phases), 3) for n in names}


def table(costs: Costs | None, seen: dict[str, float] | None) -> str:
    """Markdown rows: the measured schedule (predicted vs measured), then each published scale."""
    lines = ["| scale | MTTF | restart mode | in place |", "|---|---|---|---|"]
    if costs is not None and seen is not None:
        mttf = seen["every_s"]
        predicted = goodput(mttf, costs.restart_cost()), goodput(mttf, costs.in_place_cost(3))
        lines.append(
            f"| here: 3 hosts, a kill every {mttf:.0f} s (model / measured) | {mttf:.0f} s | "
            f"{100 * predicted[0]:.1f}% / {100 * seen['restart']:.1f}% | "
            f"{100 * predicted[1]:.1f}% / {100 * seen['in-place']:.1f}% |"
        )
    at_scale = Costs(**{k: v for k, v in ASSUMED.items() if k != "gpus_per_group"})  # type: ignore[arg-type]
    for name, gpus, mttf in SCALES:
        groups = gpus // int(ASSUMED["gpus_per_group"])
        r, i = goodput(mttf, at_scale.restart_cost()), goodput(mttf, at_scale.in_place_cost(groups))
        lines.append(f"| {name} | {mttf / HOUR:.2f} h | {100 * r:.2f}% | {100 * i:.3f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the projection table (and the measured costs when a goodput result is given)."""
    p = argparse.ArgumentParser(prog="python -m bench.goodput_model", description=__doc__)
    p.add_argument("result", nargs="?", type=Path, help="a bench/results JSON holding the goodput figure")
    args = p.parse_args(argv)
    costs = seen = None
    if args.result is not None:
        costs, seen = measured_costs(json.loads(args.result.read_text()))
        print(f"measured per-phase costs: {costs}")
        print(f"restart phases, median s: {restart_phases(json.loads(args.result.read_text()))}")
    print(f"assumed at scale: {ASSUMED}")
    print(table(costs, seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
