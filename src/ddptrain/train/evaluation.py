"""Mean loss of a model over the first samples of a dataset, split over the ranks.

Shared by the trainer's periodic evaluation and `ddptrain eval`, so the two give the same number
for the same checkpoint and the same samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import Dataset, default_collate

from ddptrain.dist import DistContext, all_reduce_mean


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    dataset: Dataset[Any],
    num_samples: int,
    micro_batch_size: int,
    ctx: DistContext,
    forward: Callable[[nn.Module, Any], torch.Tensor],
) -> float:
    """Mean over ranks of each rank's mean micro-batch loss on samples [0, num_samples), rank r taking r, r+W, ...

    forward(model, batch_on_device) returns the scalar loss of one batch (under autocast if wanted).
    """
    model.eval()
    ids = list(range(ctx.rank, num_samples, ctx.world_size))
    total = torch.zeros((), device=ctx.device)
    batches = 0
    for i in range(0, len(ids), micro_batch_size):
        batch = default_collate([dataset[j] for j in ids[i : i + micro_batch_size]])
        total += forward(model, batch).float()
        batches += 1
    return float(all_reduce_mean(ctx, total / max(batches, 1)))
