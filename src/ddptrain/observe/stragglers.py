"""Straggler detection at any world size: slow compute on one rank, slow communication for all.

Under DDP every rank waits for the slowest one inside the gradient all-reduce, so wall step times
are equal and cannot name the straggler. What differs is each rank's *local* time (perf.StepTimer:
data, forward, backward compute up to its last gradient bucket, optimizer): a rank never waits for
another there. Every `every` steps the ranks gather their per-step local times, CPU waits and
all-reduce waits, and each rank runs the same `StragglerDetector` on them:

* slow compute: rank r's busy time (local time less the time its thread waited for a CPU, which
  other processes on an oversubscribed host cause, not the rank) over the last `window` steps,
  against the median of the *other* ranks'. Each step counts up to `cap` times the window's median
  step, so one descheduled step cannot make a straggler while a slowdown spread over the steps
  counts in full. A slowdown every rank shares (a loaded machine, a bigger batch) cancels out in
  the ratio, and at two ranks the other rank is the reference (a median including r itself could
  never exceed 2x). The ratio must stay above `factor` for `confirm` checks in a row.
* slow communication: in each step the rank that reached the all-reduce last waits only for the
  transfer itself, so the minimum wait over ranks is the communication time. Its median over the
  window is compared with its own baseline (the first full window), by `comm_factor`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.dist import DistContext
from ddptrain.observe import links
from ddptrain.observe.perf import StepTimer

log = logging.getLogger(__name__)
COMM_FLOOR_S = 0.005  # a slower all-reduce must also be this much slower in absolute terms


@dataclass
class Finding:
    """One straggler or slow-communication verdict of a check."""

    kind: str  # "compute" (rank is slow) or "comm" (the all-reduce is slow)
    ratio: float
    seconds: float  # the slow value, per step
    reference: float  # the others' median (compute) or the baseline (comm), per step
    rank: int | None = None


@dataclass
class StragglerDetector:
    """Pure state machine over per-step timings of all ranks (the same on every rank)."""

    world_size: int
    window: int = 30
    factor: float = 1.15
    confirm: int = 2
    cap: float = 3.0
    comm_factor: float = 2.0
    _busy: list[deque[float]] = field(default_factory=list)
    _comm: deque[float] = field(default_factory=deque)
    _strikes: list[int] = field(default_factory=list)
    _comm_strikes: int = 0
    comm_baseline: float | None = None

    def __post_init__(self) -> None:
        self._busy = [deque(maxlen=self.window) for _ in range(self.world_size)]
        self._comm = deque(maxlen=self.window)
        self._strikes = [0] * self.world_size

    def _capped_means(self) -> list[float]:
        limit = self.cap * median(x for h in self._busy for x in h)
        return [sum(min(x, limit) for x in h) / len(h) for h in self._busy]

    def ratios(self) -> list[float]:
        """Each rank's capped mean busy time over the median of the other ranks' (1.0 until the window is full)."""
        if len(self._busy[0]) < self.window or self.world_size < 2:
            return [1.0] * self.world_size
        means = self._capped_means()
        out = []
        for r, mine in enumerate(means):
            ref = median(means[:r] + means[r + 1 :])
            out.append(mine / ref if ref > 0 else 1.0)
        return out

    def add(self, local: list[list[float]], comm: list[list[float]], wait: list[list[float]]) -> list[Finding]:
        """Feed the steps since the last check (local[r][i], comm[r][i], CPU wait[r][i]); returns what is confirmed now."""
        for i in range(len(local[0])):
            column = [row[i] for row in local]
            if not all(math.isfinite(x) for x in column):
                continue  # a step some rank did not time (its first check after start or resume)
            for r, x in enumerate(column):
                self._busy[r].append(max(0.0, x - wait[r][i]))
            self._comm.append(min(row[i] for row in comm))
        findings = []
        ratios, means = self.ratios(), None
        for r, ratio in enumerate(ratios):
            self._strikes[r] = self._strikes[r] + 1 if ratio > self.factor else 0
            if self._strikes[r] >= self.confirm:
                means = means or self._capped_means()  # a confirmed ratio means the window is full
                findings.append(Finding("compute", ratio, means[r], median(means[:r] + means[r + 1 :]), r))
        # A straggler slows the all-reduce too (it is the last to arrive, and its own communication
        # thread competes with it): communication is only judged when no rank computes slower.
        comm_finding = self._check_comm(judge=not findings)
        if comm_finding is not None:
            findings.append(comm_finding)
        return findings

    def _check_comm(self, judge: bool) -> Finding | None:
        if len(self._comm) < self.window or self.world_size < 2:
            return None
        now = median(self._comm)
        if self.comm_baseline is None:
            self.comm_baseline = now
            return None
        base = self.comm_baseline
        slow = judge and now > base * self.comm_factor and now > base + COMM_FLOOR_S
        self._comm_strikes = self._comm_strikes + 1 if slow else 0
        if self._comm_strikes >= self.confirm:
            return Finding("comm", now / base if base > 0 else math.inf, now, base)
        return None

    def comm_median(self) -> float | None:
        """The median communication time over the window (None before any step)."""
        return median(self._comm) if self._comm else None


class StragglerMonitor:
    """Every `every` steps: gather every rank's per-step timings (one all-gather) and run the detector.

    An observer of the loop (train/hooks.py): `step_ended` takes the timer's steps on check steps, writes the
    record through `write` (rank 0's metrics writer) and logs the warnings on every rank.
    """

    def __init__(
        self, ctx: DistContext, timer: StepTimer, write: Callable[..., None], every: int, factor: float, window: int
    ) -> None:
        self.ctx, self.every, self.timer, self.write = ctx, every, timer, write
        self.hosts = list(ctx.hosts) or [ctx.hostname]
        self.detector = StragglerDetector(ctx.world_size, window=window, factor=factor)
        self._flagged: set[Any] = set()  # what was already warned about (warn once per episode)

    def due(self, step: int) -> bool:
        """True on the steps where every rank takes part in a check."""
        return bool(self.every) and self.ctx.is_distributed and step % self.every == 0

    def step_ended(self, step: int) -> None:
        """All ranks, after each step's logs: on check steps compare the timer's step times (an all-gather)."""
        if not self.due(step):
            return
        record, warnings = self.check(step, *self.timer.take_steps())
        self.write("ranks", **record)
        for warning in warnings:
            log.warning(warning)

    def _gather(self, *series: list[float]) -> list[list[list[float]]]:
        # One tensor per rank: each series' last `every` values, NaN-padded in front when fewer.
        n = self.every
        flat: list[float] = []
        for values in series:
            flat += [math.nan] * max(0, n - len(values)) + values[-n:]
        mine = torch.tensor(flat, dtype=torch.float64, device=self.ctx.device)
        out = [torch.empty_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(out, mine, group=self.ctx.group)
        rows = [t.tolist() for t in out]
        return [[row[k * n : (k + 1) * n] for row in rows] for k in range(len(series))]

    def check(
        self, step: int, local: list[float], comm: list[float], wait: list[float]
    ) -> tuple[dict[str, Any], list[str]]:
        """All ranks: gather, detect; returns the metrics record and the warnings (new episodes only)."""
        all_local, all_comm, all_wait = self._gather(local, comm, wait)
        findings = self.detector.add(all_local, all_comm, all_wait)
        record: dict[str, Any] = {
            "step": step,
            "local_step_s": [_mean(row) for row in all_local],
            "cpu_wait_s": [_mean(row) for row in all_wait],
            "hosts": self.hosts,
            "ratios": [round(x, 4) for x in self.detector.ratios()],
            "factor": self.detector.factor,
            "window": self.detector.window,
        }
        comm_s = self.detector.comm_median()
        if comm_s is not None:
            record["comm_s"] = comm_s
            record["comm_baseline_s"] = self.detector.comm_baseline
        warnings, current = [], set()
        for f in findings:
            key = ("compute", f.rank) if f.kind == "compute" else ("comm",)
            current.add(key)
            if f.kind == "compute" and f.rank is not None:
                record.update(straggler_rank=f.rank, straggler_host=self.hosts[f.rank], ratio=f.ratio)
            else:
                record.update(slow_comm_ratio=f.ratio)
            if key in self._flagged:
                continue
            warning = self._describe(step, f)
            if f.kind == "comm":
                # A new slow-communication episode: every rank found it from the same numbers, so
                # all probe their links now, together, to say whose link it is.
                verdict = links.judge(links.probe(self.ctx), self.hosts)
                record["links"] = [[x.src, x.dst, x.seconds] for x in verdict.slow]
                record.update(slow_link=verdict.where, slow_comm_host=verdict.host)
                warning += "; " + links.describe(verdict, self.hosts)
            warnings.append(warning)
        self._flagged = current
        return record, warnings

    def _describe(self, step: int, f: Finding) -> str:
        w = self.detector.window
        if f.kind == "compute" and f.rank is not None:
            return (
                f"straggler at step {step}: rank {f.rank} on {self.hosts[f.rank]} computes {f.ratio:.2f}x "
                f"the other ranks' median ({f.seconds * 1000:.1f} vs {f.reference * 1000:.1f} ms/step of compute, net of "
                f"waiting for a CPU, over the last {w} steps; threshold {self.detector.factor}x); the others wait "
                f"for it in the gradient all-reduce"
            )
        return (
            f"slow communication at step {step}: the gradient all-reduce takes {f.seconds * 1000:.1f} ms "
            f"after the last rank reaches it, {f.ratio:.1f}x its baseline {f.reference * 1000:.1f} ms (every rank "
            f"waits; no rank computes slower than the others)"
        )


def _mean(values: list[float]) -> float:
    """Mean of the finite values (0.0 when a rank timed none of them: its first check after a resume)."""
    finite = [x for x in values if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else 0.0
