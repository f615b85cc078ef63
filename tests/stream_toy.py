"""Streams (IterableDatasets) whose items carry their id, and a model that records the ids it trains on.

Used through data.target=stream_toy:build_streams and model.target=stream_toy:build_model by
tests/dist/test_streams_dist.py, and directly by tests/unit/test_stream.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import IterableDataset
from toy import IdDataset, RecordingRegressor


class PlainStream(IterableDataset):
    """Items (id, x, y) for id 0..n-1, the same sequence from the start of every iteration; no state."""

    def __init__(self, n: int, dim: int) -> None:
        self.items = IdDataset(n, dim, seed=0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for i in range(len(self.items)):
            yield self.items[i]


class StatefulStream(PlainStream):
    """The same items, from where the last iteration stopped; it says where that is and goes back there
    (torchdata's protocol)."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__(n, dim)
        self.next = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        while self.next < len(self.items):
            self.next += 1
            yield self.items[self.next - 1]
        self.next = 0  # the pass is over: the next one starts from the beginning

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


def build_streams(n: int = 40, dim: int = 8, stateful: bool = True) -> tuple[IterableDataset, None]:
    return (StatefulStream if stateful else PlainStream)(n, dim), None


def build_model(dim: int = 8, record_dir: str = "", die_at_call: int = 0, marker: str = "") -> nn.Module:
    """toy.RecordingRegressor; with die_at_call, rank 0 SIGKILLs itself at that training forward, once."""
    return RecordingRegressor(dim, record_dir, die_at_call, marker)
