"""Mean loss of a model over a fixed set of samples, whatever the number of ranks.

Shared by the trainer's periodic evaluation and `ddptrain eval`, so the two give the same number
for the same checkpoint: the samples are the first `eval_samples(...)` of the dataset (a count
that depends on the config, never on the world size), each read by exactly one rank, and the
result is the mean over samples: every batch's loss (a mean over its samples, as the model
protocol returns it) is weighted by the batch's sample count (a padded batch's: its target tokens),
and the ranks all-reduce one (sum, count) pair. Metrics of your own (train/custom_metrics.py) are weighed
like the loss and travel in the same all-reduce: `Evaluation.metrics`, keyed by their names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import Dataset, default_collate

from ddptrain.data.collate import IGNORE_INDEX
from ddptrain.dist import DistContext
from ddptrain.models.loss import extract_loss, model_output, to_device
from ddptrain.train.custom_metrics import CustomMetrics
from ddptrain.train.precision import Precision


def eval_samples(eval_batches: int, global_batch_size: int, dataset_len: int) -> int:
    """How many samples one evaluation reads: eval_batches global batches, or the whole set when smaller.

    eval_batches 0 means the whole set (`ddptrain eval`'s default).
    """
    wanted = eval_batches * global_batch_size if eval_batches else dataset_len
    return min(wanted, dataset_len)


@dataclass(frozen=True)
class EvalBatch:
    """One forward pass of an evaluation: the sample ids, and whether its loss counts (False: a filler)."""

    ids: list[int]
    counts: bool = True


def rank_batches(num_samples: int, world_size: int, rank: int, micro_batch_size: int) -> list[EvalBatch]:
    """Rank `rank`'s batches over samples [0, num_samples): it takes rank, rank + W, ... in micro-batches.

    Every rank gets the same number of batches (sharded models and DDP buffers run collectives in the
    forward, so every rank must call it equally often): a rank whose share ends a batch earlier runs one
    filler batch (sample 0) that does not count. Over all ranks, each sample counts exactly once.
    """
    per_rank = -(-num_samples // world_size)  # the largest share (rank 0's)
    n_batches = -(-per_rank // micro_batch_size)
    ids = list(range(rank, num_samples, world_size))
    batches = [EvalBatch(ids[i : i + micro_batch_size]) for i in range(0, len(ids), micro_batch_size)]
    return batches + [EvalBatch([0], counts=False)] * (n_batches - len(batches))


@dataclass(frozen=True)
class Evaluation:
    """An evaluation's mean loss and the means of the metrics the forwards measured (the same on every rank)."""

    loss: float
    metrics: dict[str, float]
    sources: dict[str, float] = field(default_factory=dict)  # a mixture's: each source's own val loss, by name


Measured = tuple[torch.Tensor, Mapping[str, torch.Tensor]]  # a batch's mean loss and its metrics


def measured_forward(
    precision: Precision, device: torch.device, model_name: str, custom: CustomMetrics
) -> Callable[[nn.Module, Any], Measured]:
    """The forward of evaluate_loss for a run: the batch on device, under the run's autocast, its loss and metrics."""

    def forward(model: nn.Module, batch: Any) -> Measured:
        batch = to_device(batch, device)
        with precision.autocast():
            output = model_output(model, batch)
            return extract_loss(output, model_name), custom.measure(output, batch)

    return forward


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    dataset: Dataset[Any],
    num_samples: int,
    micro_batch_size: int,
    ctx: DistContext,
    forward: Callable[[nn.Module, Any], Measured],
    collate: Callable[[list[Any]], Any] = default_collate,
) -> Evaluation | None:
    """Mean loss (and metrics) over samples [0, num_samples) of dataset, split over the ranks of ctx; None for
    no samples.

    forward(model, batch) returns the scalar mean loss of one batch and its metrics (under autocast if
    wanted); collate makes the batch from the samples (the training loader's: data.collate).
    """
    if num_samples < 1:
        return None
    model.eval()
    # float64 sums: the total must not depend on how the samples were grouped into batches and ranks.
    # [loss, weight, metric...]: the metrics' names come from the first batch (every rank runs one).
    totals: torch.Tensor | None = None
    names: list[str] = []
    for batch in rank_batches(num_samples, ctx.world_size, ctx.rank, micro_batch_size):
        samples = collate([dataset[j] for j in batch.ids])
        loss, metrics = forward(model, samples)
        if totals is None:
            names = sorted(metrics)
            totals = torch.zeros(2 + len(names), dtype=torch.float64, device=ctx.device)
        if batch.counts:
            weight = _weight(samples, len(batch.ids), ctx.device)
            values = torch.stack([loss.detach(), *(metrics[n].detach() for n in names)]).double()
            # A batch with no target (every sample one token) has a NaN mean that must not count.
            weighted = torch.where(weight > 0, values * weight, 0.0)
            totals[0] += weighted[0]
            totals[1] += weight
            totals[2:] += weighted[1:]
    assert totals is not None  # every rank runs at least one batch
    if ctx.is_distributed:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=ctx.group)
    loss_sum, count, *sums = totals.tolist()
    return Evaluation(float(loss_sum / count), {n: s / count for n, s in zip(names, sums)})


def _weight(batch: Any, n_samples: int, device: torch.device) -> torch.Tensor:
    """What a batch's mean loss averages over: its next-token targets for a padded batch (a mapping with
    `labels`, shifted by one as the built-in models and transformers do), so val_loss is the mean over
    tokens however samples of different lengths are grouped into batches and ranks; else its samples."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() == 2:
        return (labels[:, 1:] != IGNORE_INDEX).sum().to(device, torch.float64)
    return torch.tensor(float(n_samples), dtype=torch.float64, device=device)
