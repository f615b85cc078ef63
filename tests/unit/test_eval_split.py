"""Evaluation's samples: a fixed set whatever the world size, each counted once, a true mean over samples."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from ddptrain.dist import DistContext
from ddptrain.train.evaluation import eval_samples, evaluate_loss, rank_batches


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 200), world=st.integers(1, 9), mb=st.integers(1, 17))
def test_every_sample_counts_exactly_once_and_every_rank_runs_as_many_batches(n: int, world: int, mb: int) -> None:
    per_rank = [rank_batches(n, world, r, mb) for r in range(world)]
    counted = sorted(i for batches in per_rank for b in batches if b.counts for i in b.ids)
    assert counted == list(range(n))
    assert len({len(batches) for batches in per_rank}) == 1  # sharded forwards need equal calls on every rank
    assert all(1 <= len(b.ids) <= mb for batches in per_rank for b in batches)
    sizes = [sum(len(b.ids) for b in batches if b.counts) for batches in per_rank]
    assert max(sizes, default=0) - min(sizes, default=0) <= 1  # an uneven split leaves a rank one sample short


@given(batches=st.integers(0, 50), gbs=st.integers(1, 64), size=st.integers(0, 5000))
def test_the_number_of_samples_depends_on_the_config_and_the_set_only(batches: int, gbs: int, size: int) -> None:
    n = eval_samples(batches, gbs, size)
    assert n == (min(batches * gbs, size) if batches else size)


class MeanOfX(nn.Module):
    """A model whose batch loss is the batch's mean x (the model protocol's mean loss per batch), and a metric: its max."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": x.mean(), "max": x.max()}


def measured(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(*batch)
    return out["loss"], {"max": out["max"]}


def test_a_short_last_batch_weighs_by_its_samples_and_so_do_the_metrics() -> None:
    x = torch.arange(10, dtype=torch.float32)
    data = TensorDataset(x)
    result = evaluate_loss(MeanOfX(), data, 10, 4, DistContext(), measured)
    # batches of 4, 4 and 2: the mean of the three batch means would be (1.5 + 5.5 + 8.5) / 3 = 5.1667
    assert result is not None and result.loss == x.mean().item() == 4.5
    assert result.metrics == {"max": pytest.approx((4 * 3 + 4 * 7 + 2 * 9) / 10)}  # each batch's max, weighed alike
    assert evaluate_loss(MeanOfX(), data, 0, 4, DistContext(), measured) is None
