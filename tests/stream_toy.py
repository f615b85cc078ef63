"""Streams (IterableDatasets) whose items carry their id, and a model that records the ids it trains on.

Used through data.target=stream_toy:build_streams and model.target=stream_toy:build_model by
tests/dist/test_streams_dist.py, and directly by tests/unit/test_stream.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
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


class DyingRegressor(RecordingRegressor):
    """RecordingRegressor that SIGKILLs rank 0's process at its n-th training forward, once (a marker file)."""

    def __init__(self, dim: int, record_dir: str, die_at_call: int, marker: str) -> None:
        super().__init__(dim, record_dir)
        self.calls, self.die_at_call, self.marker = 0, die_at_call, Path(marker)
        self.armed = os.environ.get("RANK", "0") == "0" and not self.marker.exists()

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.armed and self.calls == self.die_at_call:
                self.marker.write_text(str(self.calls))
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(ids, x, y)


def build_model(dim: int = 8, record_dir: str = "", die_at_call: int = 0, marker: str = "") -> nn.Module:
    return DyingRegressor(dim, record_dir, die_at_call, marker) if die_at_call else RecordingRegressor(dim, record_dir)
