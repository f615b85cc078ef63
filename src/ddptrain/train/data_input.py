"""Where a rank's micro-batches come from: the data position the trainer saves and advances, and its loader.

The micro-batches' weights (micro_batch_weights) make a step's loss the mean over the target tokens of all its
micro-batches on all ranks.

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

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddptrain.config import Config
from ddptrain.data.collate import IGNORE_INDEX
from ddptrain.data.sampler import DataPosition, ResumableDistributedSampler
from ddptrain.data.stream import stream_input
from ddptrain.dist import DistContext


def training_input(
    cfg: Config, ctx: DistContext, train_set: Dataset[Any], collate: Callable[[list[Any]], Any]
) -> tuple[DataPosition, Iterable[Any]]:
    """The data position and the loader of this rank's micro-batches: a map-style dataset through the
    resumable sampler (a mixture's positions in order), an IterableDataset as one stream (data/stream.py)."""
    batch, micro = cfg.train.global_batch_size, cfg.data.micro_batch_size
    make_loader = functools.partial(data_loader, cfg, ctx)
    if isinstance(train_set, IterableDataset):
        return stream_input(train_set, batch, ctx.rank, ctx.world_size, micro, collate, make_loader)
    stream = getattr(train_set, "sample_order", None) == "stream"  # a mixture: positions, not a shuffle
    n = len(train_set)  # type: ignore[arg-type]  # map-style datasets have a length
    sampler = ResumableDistributedSampler(n, batch, ctx.rank, ctx.world_size, cfg.run.seed, stream=stream)
    return sampler, make_loader(train_set, batch_size=micro, sampler=sampler, collate_fn=collate)


def data_loader(cfg: Config, ctx: DistContext, dataset: Dataset[Any], **how: Any) -> DataLoader[Any]:
    """A DataLoader of dataset with data.num_workers, pinned on CUDA, batched as `how` says."""
    # The loader gets its own generator: creating an iterator (at resume, at each epoch)
    # must not draw from the global torch RNG, or a resumed run's dropout would diverge.
    return DataLoader(
        dataset,
        num_workers=cfg.data.num_workers,
        pin_memory=ctx.device.type == "cuda",
        generator=torch.Generator().manual_seed(cfg.run.seed + ctx.rank),
        **how,
    )


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
