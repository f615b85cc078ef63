"""data/stream.py: an IterableDataset as one global stream, split across ranks and workers, resumed exactly."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stream_toy import PlainStream, StatefulStream
from torch.utils.data import DataLoader, IterableDataset, default_collate

from ddptrain.data.identity import datasets_identity
from ddptrain.data.stream import StreamPosition, stream_input
from ddptrain.errors import DataError


def ranks(
    stream: type[IterableDataset], world: int, batch: int, micro: int, workers: int = 0, n: int = 30
) -> list[Any]:
    """Every rank's (position, iterator of micro-batches), each over its own copy of the stream."""
    out = []
    for rank in range(world):
        position, loader = stream_input(
            stream(n, 2),
            batch,
            rank,
            world,
            micro,
            default_collate,
            lambda ds, **how: DataLoader(ds, num_workers=workers, **how),
        )
        out.append((position, loader))
    return out


def train_ids(every: list[Any], steps: int, batch: int, micro: int) -> list[list[int]]:
    """The ids each step trains on across all ranks (each rank's share in rank order), as the trainer draws them."""
    iterators = [iter(loader) for _, loader in every]
    accum = batch // len(every) // micro
    out = []
    for _ in range(steps):
        step: list[int] = []
        for it, (position, _) in zip(iterators, every):
            for _ in range(accum):
                step += next(it)[0].tolist()
            position.advance()
        out.append(step)
    return out


def resumed(every: list[Any], state: dict[str, Any]) -> list[Any]:
    for position, _ in every:
        position.load_state_dict(state)
    return every


@settings(max_examples=15, deadline=None)
@given(world=st.sampled_from([1, 2, 3]), micro=st.sampled_from([1, 2]), steps=st.integers(1, 9))
def test_ranks_split_each_global_batch_without_overlap_and_passes_repeat(world: int, micro: int, steps: int) -> None:
    batch = 6 * micro  # divides over 1, 2 and 3 ranks
    ids = train_ids(ranks(PlainStream, world, batch, micro), steps, batch, micro)
    per_pass = 30 // batch  # the incomplete last global batch of a pass is dropped
    expected = [list(range((s % per_pass) * batch, (s % per_pass + 1) * batch)) for s in range(steps)]
    assert ids == expected


def test_workers_share_a_ranks_micro_batches_in_order() -> None:
    alone = train_ids(ranks(StatefulStream, 2, 8, 2), 5, 8, 2)
    assert train_ids(ranks(StatefulStream, 2, 8, 2, workers=2), 5, 8, 2) == alone


@pytest.mark.parametrize("stream", [StatefulStream, PlainStream])
@pytest.mark.parametrize(("world", "later", "workers"), [(2, 2, 0), (2, 3, 0), (3, 1, 2)])
def test_a_resumed_stream_continues_at_the_next_item_at_any_world_size(
    stream: type[IterableDataset], world: int, later: int, workers: int
) -> None:
    batch, micro, steps = 12, 2, 7  # 30 items: 2 steps per pass, so the resume lands mid-pass or on its end
    reference = train_ids(ranks(stream, 1, batch, micro), steps, batch, micro)
    first = ranks(stream, world, batch, micro, workers)
    before = train_ids(first, 3, batch, micro)
    state = first[0][0].state_dict()
    assert [p.state_dict() for p, _ in first] == [state] * world  # the position is the same on every rank
    assert (state["dataset"] is not None) == (stream is StatefulStream)
    after = train_ids(resumed(ranks(stream, later, batch, micro, workers), state), steps - 3, batch, micro)
    assert before + after == reference


def test_a_stream_shorter_than_a_global_batch_or_a_changed_batch_is_one_line() -> None:
    with pytest.raises(DataError, match="yields fewer items than one global batch of 12"):
        train_ids(ranks(PlainStream, 1, 12, 2, n=10), 1, 12, 2)
    position = StreamPosition(12, True, "S")
    with pytest.raises(DataError, match="not a multiple of the global batch 12"):
        position.load_state_dict({"epoch": 0, "position": 8, "steps_per_epoch": 0, "dataset": None})
    with pytest.raises(DataError, match="map-style dataset's"):
        position.load_state_dict({"epoch": 0, "position": 12, "seed": 1})


def test_a_streams_identity_reads_its_next_items_and_leaves_its_state() -> None:
    stream = StatefulStream(30, 2)
    identity = datasets_identity(stream, None, "t")
    assert identity["train_len"] is None and stream.next == 0  # read three items, then put back
    assert identity == datasets_identity(PlainStream(30, 2), None, "t")  # the same first items
    assert identity != datasets_identity(PlainStream(30, 3), None, "t")
    with pytest.raises(DataError, match="validation dataset PlainStream has no len"):
        datasets_identity(stream, PlainStream(4, 2))
