"""Straggler detection at any world size: slow compute on one rank, slow communication for all.

Under DDP every rank waits for the slowest one inside the gradient all-reduce, so wall step times
are equal and cannot name the straggler. What differs is each rank's *local* time (perf.StepTimer:
data, forward, backward compute up to its last gradient bucket, optimizer): a rank never waits for
another there. Every `every` steps the ranks gather their per-step local and all-reduce-wait times
and each rank runs the same `StragglerDetector` on them:

* slow compute: rank r's local time over the last `window` steps (its `trim` slowest steps left
  out, so one scheduling hiccup is not a straggler) against the median of the *other* ranks'. A
  slowdown every rank shares (a loaded machine, a bigger batch) cancels out in that ratio, and at
  two ranks the other rank is the reference (a median including r itself could never exceed 2x).
  The ratio must stay above `factor` for `confirm` checks in a row.
* slow communication: in each step the rank that reached the all-reduce last waits only for the
  transfer itself, so the minimum wait over ranks is the communication time. Its median over the
  window is compared with its own baseline (the first full window), by `comm_factor`.

Each rank also reports how long its main thread was runnable but waiting for a CPU (Linux
schedstat). When that explains at least half of a finding's excess, the warning says so: the
rank is slow because other processes compete for its cores (an oversubscribed host), not because
its device or data is slow.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.dist import DistContext

COMM_FLOOR_S = 0.005  # a slower all-reduce must also be this much slower in absolute terms
EXPLAINED = 0.5  # share of a finding's excess time that CPU waiting must cover to be named its cause


def cpu_wait_s() -> float:
    """Seconds this process's main thread spent runnable but waiting for a CPU (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class Finding:
    """One straggler or slow-communication verdict of a check."""

    kind: str  # "compute" (rank is slow) or "comm" (the all-reduce is slow)
    ratio: float
    seconds: float  # the slow value, per step
    reference: float  # the others' median (compute) or the baseline (comm), per step
    rank: int | None = None
    cpu_wait: float = 0.0  # of `seconds`, per step: waiting for a CPU (the flagged rank's, or the median rank's)

    @property
    def cpu_contention(self) -> bool:
        """True when waiting for a CPU explains most of the excess over the reference."""
        return self.cpu_wait >= EXPLAINED * (self.seconds - self.reference) > 0


@dataclass
class StragglerDetector:
    """Pure state machine over per-step timings of all ranks (the same on every rank)."""

    world_size: int
    window: int = 30
    factor: float = 1.2
    confirm: int = 2
    trim: int = 2
    comm_factor: float = 2.0
    _local: list[deque[float]] = field(default_factory=list)
    _comm: deque[float] = field(default_factory=deque)
    _strikes: list[int] = field(default_factory=list)
    _comm_strikes: int = 0
    comm_baseline: float | None = None

    def __post_init__(self) -> None:
        self._local = [deque(maxlen=self.window) for _ in range(self.world_size)]
        self._comm = deque(maxlen=self.window)
        self._strikes = [0] * self.world_size

    def ratios(self) -> list[float]:
        """Each rank's trimmed window time over the median of the other ranks' (1.0 until the window is full)."""
        if len(self._local[0]) < self.window or self.world_size < 2:
            return [1.0] * self.world_size
        totals = [sum(sorted(h)[: self.window - self.trim]) for h in self._local]
        out = []
        for r, mine in enumerate(totals):
            ref = median(totals[:r] + totals[r + 1 :])
            out.append(mine / ref if ref > 0 else 1.0)
        return out

    def add(self, local: list[list[float]], comm: list[list[float]]) -> list[Finding]:
        """Feed the steps since the last check (local[r][i], comm[r][i]); returns what is confirmed now."""
        for i in range(len(local[0])):
            column = [row[i] for row in local]
            if not all(math.isfinite(x) for x in column):
                continue  # a step some rank did not time (its first check after start or resume)
            for r, x in enumerate(column):
                self._local[r].append(x)
            self._comm.append(min(row[i] for row in comm))
        findings = []
        ratios = self.ratios()
        for r, ratio in enumerate(ratios):
            self._strikes[r] = self._strikes[r] + 1 if ratio > self.factor else 0
            if self._strikes[r] >= self.confirm:
                others = [sum(h) / len(h) for q, h in enumerate(self._local) if q != r]
                findings.append(Finding("compute", ratio, sum(self._local[r]) / len(self._local[r]), median(others), r))
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

    def per_rank_means(self) -> tuple[list[float], float | None]:
        """Mean local time per rank over the window, and the median communication time."""
        means = [sum(h) / len(h) if h else 0.0 for h in self._local]
        return means, (median(self._comm) if self._comm else None)


class StragglerMonitor:
    """Every `every` steps: gather every rank's per-step timings (one all-gather) and run the detector."""

    def __init__(self, ctx: DistContext, every: int, factor: float, window: int = 30) -> None:
        self.ctx, self.every = ctx, every
        self.hosts = list(ctx.hosts) or [ctx.hostname]
        self.detector = StragglerDetector(ctx.world_size, window=window, factor=factor)
        self._flagged: set[Any] = set()  # what was already warned about (warn once per episode)
        self._waits: deque[list[float]] = deque(maxlen=max(1, -(-window // max(every, 1))))
        self._wait_mark = cpu_wait_s()

    def due(self, step: int) -> bool:
        """True on the steps where every rank takes part in a check."""
        return bool(self.every) and self.ctx.is_distributed and step % self.every == 0

    def _gather(
        self, local: list[float], comm: list[float]
    ) -> tuple[list[list[float]], list[list[float]], list[float]]:
        n = self.every
        pad = [math.nan] * max(0, n - len(local))
        now = cpu_wait_s()
        wait, self._wait_mark = (now - self._wait_mark) / max(len(local), 1), now
        mine = torch.tensor(pad + local[-n:] + pad + comm[-n:] + [wait], dtype=torch.float64, device=self.ctx.device)
        out = [torch.empty_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(out, mine, group=self.ctx.group)
        rows = [t.tolist() for t in out]
        return [row[:n] for row in rows], [row[n : 2 * n] for row in rows], [row[-1] for row in rows]

    def check(self, step: int, local: list[float], comm: list[float]) -> tuple[dict[str, Any], list[str]]:
        """All ranks: gather, detect; returns the metrics record and the warnings (new episodes only)."""
        all_local, all_comm, waits = self._gather(local, comm)
        self._waits.append(waits)
        cpu_wait = [sum(w[r] for w in self._waits) / len(self._waits) for r in range(self.ctx.world_size)]
        findings = self.detector.add(all_local, all_comm)
        for f in findings:
            f.cpu_wait = (
                cpu_wait[f.rank] - median(cpu_wait[: f.rank] + cpu_wait[f.rank + 1 :])
                if f.rank is not None
                else median(cpu_wait)
            )
        means, comm_s = self.detector.per_rank_means()
        record: dict[str, Any] = {
            "step": step,
            "local_step_s": means,
            "hosts": self.hosts,
            "ratios": [round(x, 4) for x in self.detector.ratios()],
            "median_s": median(means),
            "factor": self.detector.factor,
            "window": self.detector.window,
            "cpu_wait_s": cpu_wait,
        }
        if comm_s is not None:
            record["comm_s"] = comm_s
            record["comm_baseline_s"] = self.detector.comm_baseline
        warnings, current = [], set()
        for f in findings:
            key = ("compute", f.rank) if f.kind == "compute" else ("comm",)
            current.add(key)
            if f.kind == "compute" and f.rank is not None:
                record.update(
                    straggler_rank=f.rank,
                    straggler_host=self.hosts[f.rank],
                    ratio=f.ratio,
                    straggler_cpu_contention=f.cpu_contention,
                )
            else:
                record.update(slow_comm_ratio=f.ratio, slow_comm_cpu_contention=f.cpu_contention)
            if key not in self._flagged:
                warnings.append(self._describe(step, f))
        self._flagged = current
        return record, warnings

    def _describe(self, step: int, f: Finding) -> str:
        w = self.detector.window
        cause = ""
        if f.cpu_contention:
            where = self.hosts[f.rank] if f.rank is not None else ", ".join(sorted(set(self.hosts)))
            cause = (
                f"; {f.cpu_wait * 1000:.1f} ms/step of it waiting for a CPU: other processes compete for the "
                f"cores of {where}"
            )
        if f.kind == "compute" and f.rank is not None:
            return (
                f"straggler at step {step}: rank {f.rank} on {self.hosts[f.rank]} computes {f.ratio:.2f}x "
                f"the other ranks' median ({f.seconds * 1000:.1f} vs {f.reference * 1000:.1f} ms/step over the "
                f"last {w} steps, threshold {self.detector.factor}x){cause}; the others wait for it in the gradient "
                f"all-reduce"
            )
        hosts = ", ".join(sorted(set(self.hosts)))
        return (
            f"slow communication at step {step}: the gradient all-reduce takes {f.seconds * 1000:.1f} ms "
            f"after the last rank reaches it, {f.ratio:.1f}x its baseline {f.reference * 1000:.1f} ms (every rank "
            f"waits; hosts {hosts}){cause}; no rank computes slower than the others"
        )
