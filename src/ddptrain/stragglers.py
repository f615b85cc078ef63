"""Straggler detection: every N steps all ranks share their step times and rank 0 names a slow one.

Under DDP every rank waits for the slowest one inside the gradient all-reduce, so their wall step
times come out equal and cannot name the straggler. What differs is the time each rank spends
outside that wait (`local_s` from perf.StepTimer: data, forward, optimizer): that is compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

import torch.distributed as dist

from ddptrain.dist import DistContext, all_gather_floats


def gather_hostnames(ctx: DistContext) -> list[str]:
    """Every rank's hostname in rank order (one collective, at start-up)."""
    if not ctx.is_distributed:
        return [ctx.hostname]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, ctx.hostname, group=ctx.group)
    return [str(h) for h in out]


@dataclass
class Straggler:
    """The slowest rank of one check and how far it is above the median."""

    rank: int
    seconds: float
    median: float

    @property
    def ratio(self) -> float:
        """Slowest over median."""
        return self.seconds / self.median if self.median > 0 else float("inf")


def find_straggler(times: list[float], factor: float) -> Straggler | None:
    """The slowest rank when its time exceeds median x factor, else None."""
    if len(times) < 2:
        return None
    slowest = max(range(len(times)), key=times.__getitem__)
    mid = median(times)
    return Straggler(slowest, times[slowest], mid) if times[slowest] > mid * factor else None


class StragglerMonitor:
    """Every `every` steps, compares the ranks' mean local step times since the previous check."""

    def __init__(self, ctx: DistContext, every: int, factor: float) -> None:
        self.ctx, self.every, self.factor = ctx, every, factor
        self.hosts = gather_hostnames(ctx) if every and ctx.is_distributed else [ctx.hostname]

    def due(self, step: int) -> bool:
        """True on the steps where every rank takes part in a check."""
        return bool(self.every) and self.ctx.is_distributed and step % self.every == 0

    def check(self, step: int, local_s: float) -> tuple[dict[str, Any], str | None]:
        """All ranks: gather mean local step times; returns the metrics record and a warning (or None)."""
        times = all_gather_floats(self.ctx, local_s)
        found = find_straggler(times, self.factor)
        record: dict[str, Any] = {"step": step, "local_step_s": times, "hosts": self.hosts,
                                  "median_s": median(times), "factor": self.factor}
        warning = None
        if found is not None:
            record.update(straggler_rank=found.rank, straggler_host=self.hosts[found.rank], ratio=found.ratio)
            warning = (
                f"warning: straggler at step {step}: rank {found.rank} on {self.hosts[found.rank]} spends "
                f"{found.seconds * 1000:.1f} ms/step outside the gradient all-reduce, {found.ratio:.1f}x the median "
                f"{found.median * 1000:.1f} ms (threshold {self.factor}x); the other ranks wait for it"
            )
        return record, warning
