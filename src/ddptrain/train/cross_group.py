"""The in-place mode's gradient sum over replica groups, started while backward still runs.

Buckets are laid out once from the parameter order (reversed, as backward produces gradients; a new
bucket at each dtype change or when full: 1 MiB first, then dist.bucket_cap_mb, as DDP does), so every
group holds the same layout whenever it joined. DDP's own buckets cannot carry the cross-group sum:
DDP lays them out anew after a module's first iteration, so a group that just joined would hold
another layout than the others. A bucket is summed as soon as every gradient in it is final; buckets
are summed in layout order on every rank, because a process group's collectives must match in order.

Overlap needs the gradients to be final when their hook fires, which holds when the group is a
single rank (no DDP). Under DDP (several ranks per group) the gradients are the group's sum only
after backward, so every bucket is summed then.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

Reduce = Callable[[torch.Tensor], torch.futures.Future[torch.Tensor]]
FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket: small, so that the first sum starts early in backward


def bucket_layout(parameters: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Parameters in reverse order, cut into buckets of one dtype and at most cap_bytes (the first: 1 MiB)."""
    buckets: list[list[nn.Parameter]] = []
    size, cap = 0, min(cap_bytes, FIRST_BUCKET_BYTES)
    for p in reversed(parameters):
        nbytes = p.numel() * p.element_size()
        if buckets and buckets[-1][-1].dtype == p.dtype and size + nbytes <= cap:
            buckets[-1].append(p)
            size += nbytes
            continue
        if buckets:
            cap = cap_bytes
        buckets.append([p])
        size = nbytes
    return buckets


class CrossGroupGradients:
    """Sums the gradients of `parameters` over the participating groups: arm() before the last backward, then
    launch_rest() and finish() after it."""

    def __init__(self, parameters: list[nn.Parameter], cap_bytes: int, reduce: Reduce, overlap: bool) -> None:
        """reduce: sums a tensor over the groups in place (its errors go to the Manager, never raised);
        overlap: sum buckets from backward's gradient hooks (only when gradients are final there: no DDP)."""
        trained = [p for p in parameters if p.requires_grad]
        self.buckets = bucket_layout(trained, cap_bytes)
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._reduce = reduce
        self._armed = False
        self._final: set[int] = set()
        self._missing = [len(b) for b in self.buckets]
        self._next = 0  # the next bucket to launch (in layout order)
        self._pending: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []
        self._futures: list[torch.futures.Future[torch.Tensor]] = []
        if overlap:
            for p in trained:
                p.register_post_accumulate_grad_hook(self._on_final)

    def arm(self) -> None:
        """The next backward is the step's last: its gradient hooks start the sums."""
        self._armed, self._final, self._next = True, set(), 0
        self._missing = [len(b) for b in self.buckets]

    def _on_final(self, p: torch.Tensor) -> None:
        if not self._armed or id(p) in self._final:
            return
        self._final.add(id(p))
        self._missing[self._bucket_of[id(p)]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        # A parameter without a gradient adds zeros, so that every group sums the same sizes.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]
        flat = _flatten_dense_tensors(grads)
        self._pending.append((b, grads, flat))
        self._futures.append(self._reduce(flat))
        self._next = b + 1

    def launch_rest(self) -> None:
        """After the last backward: sum the buckets not started yet (all of them without overlap)."""
        self._armed = False
        while self._next < len(self.buckets):
            self._launch(self._next)

    def finish(self, failed: Callable[[], bool]) -> None:
        """Wait for every bucket's sum and write it into the gradients, unless failed() says the step failed (then
        it is discarded and its gradients dropped)."""
        futures, pending = self._futures, self._pending
        self._futures, self._pending = [], []
        for fut in futures:
            fut.wait()
        if failed():
            return
        for b, grads, flat in pending:
            for p, summed in zip(self.buckets[b], _unflatten_dense_tensors(flat, grads)):
                if p.grad is not None:
                    p.grad.copy_(summed)
