"""An IterableDataset as one global stream, split across ranks and DataLoader workers, resumed exactly.

The stream is the dataset's own iteration order, the same on every rank (the data identity check
compares its first items across ranks). Each optimizer step consumes the next
train.global_batch_size items: rank r takes its contiguous slice and cuts it into micro-batches;
with data.num_workers=k, worker w of a rank makes that rank's micro-batches j with j % k == w, and
the loader hands them back in order. Every rank and worker reads the whole stream and keeps only its
share: no item is trained on twice, at the cost of reading (not collating) the others' items.

The position is (epoch, position): position counts the items consumed in this pass over the stream,
a multiple of the global batch, so it means the same at every world size. A pass ends when the
dataset stops: the incomplete last global batch is dropped (as the map-style sampler drops it), the
end is logged, and the next pass iterates the dataset again.

Resume, at the same or another world size:
- a stateful dataset (`state_dict()` / `load_state_dict()`, the protocol torchdata's
  StatefulDataLoader uses, returning plain containers of numbers, strings and tensors): its state
  after the last consumed global batch is saved with the checkpoint and loaded into every copy (each
  rank's, each worker's): exact, without rereading;
- any other dataset: the pass is read again from its start and the consumed items are skipped:
  exact when the dataset yields the same sequence again, at the cost of rereading `position` items,
  which the run logs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ddptrain.errors import DataError

log = logging.getLogger(__name__)


def is_stateful(dataset: object) -> bool:
    """Whether the dataset can say where it is and go back there (state_dict and load_state_dict)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class StreamPosition:
    """Where the global stream is: what the trainer saves and advances, and the certificate reports."""

    def __init__(self, global_batch_size: int, stateful: bool, name: str) -> None:
        self.global_batch_size = global_batch_size
        self.stateful, self.name = stateful, name
        self.epoch = 0
        self.position = 0
        self.steps_per_epoch = 0  # steps of the last finished pass (the certificate's segments across passes)
        self.dataset_state: Any = None  # the dataset's state after `position` items (a stateful dataset)
        self.pending_state: Any = None  # the state that came with the step's last micro-batch, until advance()

    @property
    def epoch_done(self) -> bool:
        """Never known ahead: a pass ends when the dataset stops, inside the loader (StreamLoader)."""
        return False

    def set_epoch(self, epoch: int) -> None:
        """Start pass `epoch` from the stream's beginning."""
        self.epoch, self.position, self.dataset_state = epoch, 0, None

    def advance(self) -> None:
        """One optimizer step consumed the next global batch."""
        self.position += self.global_batch_size
        self.dataset_state, self.pending_state = self.pending_state, None

    def end_pass(self) -> None:
        """The dataset stopped: the next pass starts (logged: the stream repeats)."""
        self.steps_per_epoch = self.position // self.global_batch_size
        log.info(
            "data: %s ended after %d global batches; pass %d begins", self.name, self.steps_per_epoch, self.epoch + 1
        )
        self.set_epoch(self.epoch + 1)

    def ids(self, epoch: int, start: int, end: int) -> torch.Tensor:
        """The stream positions start..end of a pass (the items' ids in the certificate)."""
        return torch.arange(start, end)

    def state_dict(self) -> dict[str, Any]:
        """The stream position, the same on every rank and at any world size."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "steps_per_epoch": self.steps_per_epoch,
            "dataset": self.dataset_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position; say how the stream gets there."""
        if "dataset" not in state:
            raise DataError(
                f"the checkpoint's data position is a map-style dataset's, and {self.name} is an IterableDataset: "
                "the data changed since the checkpoint"
            )
        if state["position"] % self.global_batch_size:
            raise DataError(
                f"saved data position {state['position']} is not a multiple of the global batch "
                f"{self.global_batch_size}: train.global_batch_size changed since the checkpoint"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self.steps_per_epoch, self.dataset_state = state["steps_per_epoch"], state["dataset"]
        if self.stateful and self.dataset_state is not None:
            log.info(
                "data: %s continues from its saved state at item %d of pass %d", self.name, self.position, self.epoch
            )
        elif self.position:
            log.info(
                "data: %s has no state_dict()/load_state_dict(): rereading %d items of pass %d to reach the "
                "checkpoint's position",
                self.name,
                self.position,
                self.epoch,
            )


class _RankShare(IterableDataset[tuple[Any, Any]]):
    """This rank's micro-batches of the stream, each with the dataset's state when it ends a step (else None)."""

    def __init__(
        self,
        dataset: IterableDataset[Any],
        position: StreamPosition,
        rank: int,
        world_size: int,
        micro: int,
        collate: Callable[[list[Any]], Any],
    ) -> None:
        self.dataset, self.collate, self.micro = dataset, collate, micro
        self.global_batch = position.global_batch_size
        self.per_rank = self.global_batch // world_size
        self.lo = rank * self.per_rank
        self.stateful = position.stateful
        self.start_position, self.start_state = 0, None  # where the next iteration begins (set by StreamLoader)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if self.start_state is not None:
            self.dataset.load_state_dict(self.start_state)
        items = iter(self.dataset)
        if self.start_state is None and self.start_position:
            skipped = sum(1 for _ in itertools.islice(items, self.start_position))
            if skipped < self.start_position:
                raise DataError(
                    f"the stream ended after {skipped} items while rereading {self.start_position} to resume: "
                    "it does not yield the same items again"
                )
        micro_per_step = self.per_rank // self.micro
        count = 0  # this rank's micro-batches in this iteration: worker w makes those with count % workers == w
        while True:
            batch = list(itertools.islice(items, self.global_batch))
            if len(batch) < self.global_batch:
                return  # the pass ends; an incomplete global batch is dropped
            state = self.dataset.state_dict() if self.stateful else None  # type: ignore[attr-defined]
            mine = batch[self.lo : self.lo + self.per_rank]
            for i in range(micro_per_step):
                if count % workers == worker:
                    samples = mine[i * self.micro : (i + 1) * self.micro]
                    yield self.collate(samples), (state if i == micro_per_step - 1 else None)
                count += 1


def _as_is(item: Any) -> Any:
    return item


class StreamLoader:
    """The rank's micro-batches (the trainer's loader for a stream); iterating goes on across passes."""

    def __init__(
        self, share: _RankShare, position: StreamPosition, loader: Callable[[_RankShare], DataLoader[Any]]
    ) -> None:
        self.share, self.position, self.loader = share, position, loader(share)

    def __iter__(self) -> Iterator[Any]:
        while True:
            self.share.start_position, self.share.start_state = self.position.position, self.position.dataset_state
            started = self.position.position
            yielded = False
            for batch, state in self.loader:  # the workers get the share as it is now: its start
                yielded = True
                if state is not None:
                    self.position.pending_state = state
                yield batch
            if not yielded and started == 0:
                raise DataError(
                    f"{self.position.name} yields fewer items than one global batch of {self.share.global_batch}; "
                    "lower train.global_batch_size or use more data"
                )
            self.position.end_pass()


def stream_input(
    dataset: IterableDataset[Any],
    global_batch_size: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    collate: Callable[[list[Any]], Any],
    make_loader: Callable[..., DataLoader[Any]],
) -> tuple[StreamPosition, StreamLoader]:
    """(the position the trainer saves and advances, the loader of this rank's micro-batches) for a stream.

    make_loader(share, batch_size=None, collate_fn=...) builds the DataLoader (workers, pinning, seed)."""
    name = type(dataset).__name__
    position = StreamPosition(global_batch_size, is_stateful(dataset), name)
    share = _RankShare(dataset, position, rank, world_size, micro_batch_size, collate)

    def loader(s: _RankShare) -> DataLoader[Any]:
        return make_loader(s, batch_size=None, collate_fn=_as_is)

    return position, StreamLoader(share, position, loader)
