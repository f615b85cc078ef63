"""Where a rank's micro-batches come from: the data position the trainer saves and advances, and its loader."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddptrain.config import Config
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
