"""Agreeing on a stop across ranks without blocking any step: an all-reduce read one step late.

After each step every rank starts an asynchronous MAX all-reduce of its "stop requested" flag
and reads the result of the one it started after the previous step, which finished long ago.
Every rank starts and reads the same all-reduces at the same steps, so every rank learns of a
request at the same step: one step after the step during which the first rank saw it.

The flag lives in host memory and travels on a gloo group (the training group when the backend
is gloo, a group of its own next to NCCL): reading it never waits for the accelerator.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ddptrain.dist import DistContext


class StopAgreement:
    """`poll(requested)` on every rank after every step: the same largest level on every rank at the same step.

    A level is a small non-negative integer (0: no stop requested); see train/preemption.py.
    """

    def __init__(self, ctx: DistContext, timeout_s: float) -> None:
        self.ctx, self.timeout_s = ctx, timeout_s
        self._group: dist.ProcessGroup | None = None
        # The all-reduce works on `_flag`; `_value` is a numpy view of the same host memory, so
        # reading it is a plain memory read, not a tensor operation.
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._value = self._flag.numpy()
        self._pending: dist.Work | None = None

    def setup(self) -> None:
        """All ranks: the group the flag travels on (a collective only next to NCCL: a new gloo group)."""
        if not self.ctx.is_distributed:
            return
        if self.ctx.backend == "gloo":
            self._group = self.ctx.group
        else:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    def poll(self, requested: int) -> int:
        """All ranks, once per step: the largest level any rank had requested by the previous poll.

        requested: this rank's level (a bool works: False 0, True 1).
        """
        if not self.ctx.is_distributed:
            return requested  # one process: nobody to agree with
        if self._group is None:
            raise RuntimeError("StopAgreement.poll() before setup(): the ranks could not agree")
        agreed = self.wait()
        self._value[0] = requested
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def wait(self) -> int:
        """Finish the all-reduce in flight (at the end of fit: every rank started the same ones)."""
        if self._pending is None:
            return 0
        self._pending.wait()
        self._pending = None
        return int(self._value[0])
