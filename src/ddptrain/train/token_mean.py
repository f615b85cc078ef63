"""A step's loss as the mean over the target tokens of all its micro-batches on all ranks.

The models return the mean loss of a batch over its targets. When batches carry `labels` (instruction
data, padded batches), their target counts differ, and the mean of per-micro-batch (and, through DDP's
gradient average, per-rank) means would weight a token of a short answer more than one of a long
answer. So each micro-batch's mean is turned back into its sum and divided by the step's global target
count: micro-batch i of rank r is weighted by `n_ri * world_size / N`, N the sum of every n_ri. DDP
averages the gradients over the ranks (a division by world_size), so the step's gradient is exactly
that of sum(token losses) / N, and so is the loss: the mean over ranks of each rank's weighted sum.

N is an all-reduce of a device tensor issued before the first forward: no device-to-host read. Batches
without `labels` (the pre-training corpus's (inputs, targets) windows, where every sample has block_size
targets, so the token mean is the mean of means) keep the plain 1/accum weighting, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.data.collate import IGNORE_INDEX
from ddptrain.dist import DistContext


def target_tokens(batch: Any) -> torch.Tensor | None:
    """How many next-token targets a batch's mean loss averages over (labels shifted by one, as the built-in
    models and transformers do); None for a batch without `labels`."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() == 2:
        return (labels[:, 1:] != IGNORE_INDEX).sum()
    return None


def micro_batch_weights(batches: list[Any], ctx: DistContext) -> list[torch.Tensor] | None:
    """Each micro-batch's weight making the step's loss the global token mean (device tensors); None when a
    batch has no labels (then the step weights each micro-batch 1/accum). Every rank calls it at the same
    point of every step: with labels, it runs one all-reduce."""
    counts = [target_tokens(batch) for batch in batches]
    if not counts or any(count is None for count in counts):
        return None
    local = [count for count in counts if count is not None]
    total = torch.stack(local).sum()  # int64: exact however many tokens a step holds
    if ctx.is_distributed:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
    # A step without any target (every answer cut away) weighs nothing rather than dividing by zero.
    scale = ctx.world_size / total.clamp_min(1).to(torch.float32)
    return [count * scale for count in local]
