"""A distributed sampler whose position in the epoch can be saved, restored, and re-split.

The data stream is defined globally, independent of the number of ranks: epoch e is a seeded
permutation of all sample ids, cut into consecutive global batches of `global_batch_size`. At each
optimizer step rank r takes its contiguous slice of the next global batch. The state is just
(epoch, position), where position counts the global samples consumed in the epoch; so a run
checkpointed at W ranks continues at W' ranks at exactly the next global sample.

A dataset that is itself a stream over global positions (data/mixture.py: `sample_order = "stream"`)
gets the positions in order instead, continuing across epochs (epoch e starts where e-1 ended), so
its ids never repeat and it does its own shuffling.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import Sampler

from ddptrain.errors import DataError


class DataPosition(Protocol):
    """What the trainer and the certificate read of where the data stream is: this sampler's position, or an
    IterableDataset's (data/stream.py)."""

    global_batch_size: int
    steps_per_epoch: int
    epoch: int
    position: int

    @property
    def epoch_done(self) -> bool:
        """True when the pass is used up and the next one must start."""

    def set_epoch(self, epoch: int) -> None:
        """Start pass `epoch` from its beginning."""

    def advance(self) -> None:
        """One optimizer step consumed the next global batch."""

    def ids(self, epoch: int, start: int, end: int) -> torch.Tensor:
        """The sample ids at positions start..end of pass `epoch`."""

    def state_dict(self) -> dict[str, Any]:
        """The position, independent of the world size."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position."""


class ResumableDistributedSampler(Sampler[int]):
    """Yields this rank's sample ids for the rest of the current epoch, from `position` on."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        stream: bool = False,
    ) -> None:
        if global_batch_size % world_size:
            raise DataError(f"global batch {global_batch_size} does not split over {world_size} ranks")
        self.steps_per_epoch = num_samples // global_batch_size
        if self.steps_per_epoch < 1:
            raise DataError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}; "
                "lower train.global_batch_size or use more data"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.per_rank = global_batch_size // world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle and not stream
        self.stream = stream
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None  # the last epoch's order: ids() is called every step

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (the order is reshuffled per epoch)."""
        self.epoch = epoch
        self.position = 0

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """All sample ids of an epoch in global order (the same on every rank; not to be written to)."""
        if self._order is None or self._order[0] != epoch:
            # A permutation of the whole dataset costs milliseconds per 100k samples: made once per epoch,
            # not once per ids() call (the certificate and the in-place mode ask every step).
            self._order = (epoch, self._make_order(epoch))
        return self._order[1]

    def _make_order(self, epoch: int) -> torch.Tensor:
        if self.stream:
            return torch.arange(self.num_samples) + epoch * self.steps_per_epoch * self.global_batch_size
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def ids(self, epoch: int, start: int, end: int) -> torch.Tensor:
        """The sample ids at positions start..end of epoch `epoch`."""
        return self.epoch_order(epoch)[start:end]

    @property
    def epoch_done(self) -> bool:
        """True when every full global batch of the epoch has been consumed."""
        return self.position >= self.steps_per_epoch * self.global_batch_size

    def advance(self) -> None:
        """Record that one optimizer step consumed the next global batch."""
        self.position += self.global_batch_size

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order(self.epoch)
        lo = self.rank * self.per_rank
        for start in range(self.position, self.steps_per_epoch * self.global_batch_size, self.global_batch_size):
            yield from order[start + lo : start + lo + self.per_rank].tolist()

    def __len__(self) -> int:
        return (self.steps_per_epoch * self.global_batch_size - self.position) // self.global_batch_size * self.per_rank

    def state_dict(self) -> dict[str, Any]:
        """The stream position: independent of the world size."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position (which must fall on a global-batch boundary)."""
        if "seed" not in state:
            raise DataError(
                "the checkpoint's data position is an IterableDataset's and the training set is map-style: "
                "the data changed since the checkpoint"
            )
        if state["position"] % self.global_batch_size:
            raise DataError(
                f"saved data position {state['position']} is not a multiple of the global batch "
                f"{self.global_batch_size}: train.global_batch_size changed since the checkpoint"
            )
        if state["seed"] != self.seed:
            self._order = None
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
