"""The resumable distributed sampler: disjoint shares, per-epoch shuffles, world-size-free position."""

from __future__ import annotations

import pytest

from ddptrain.data.sampler import ResumableDistributedSampler
from ddptrain.errors import DataError


def shares(n: int, gbs: int, world: int, seed: int, epoch: int = 0) -> list[list[int]]:
    out = []
    for rank in range(world):
        s = ResumableDistributedSampler(n, gbs, rank, world, seed)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def test_ranks_get_disjoint_shares_covering_the_epoch() -> None:
    parts = shares(96, 12, 3, seed=5)
    assert all(len(p) == 32 for p in parts)
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == len(flat) == 96
    assert set(flat) == set(range(96))


def test_order_changes_per_epoch_and_is_reproducible() -> None:
    e0, e1 = shares(64, 8, 2, seed=1, epoch=0), shares(64, 8, 2, seed=1, epoch=1)
    assert e0 != e1
    assert e0 == shares(64, 8, 2, seed=1, epoch=0)
    assert e0 != shares(64, 8, 2, seed=2, epoch=0)


def test_ids_follow_the_epoch_and_the_seed_a_resume_brings() -> None:
    """ids() keeps one epoch's order (it is asked every step): asking another epoch, or loading a state with another
    seed, gives that epoch's and seed's order, as a fresh sampler has it."""
    s = ResumableDistributedSampler(64, 8, 0, 1, seed=1)
    fresh = {
        (seed, e): ResumableDistributedSampler(64, 8, 0, 1, seed).ids(e, 0, 64).tolist()
        for seed in (1, 2)
        for e in (0, 1)
    }
    assert s.ids(0, 0, 64).tolist() == fresh[1, 0] and s.ids(1, 8, 16).tolist() == fresh[1, 1][8:16]
    s.load_state_dict({"seed": 2, "epoch": 1, "position": 8})
    assert s.ids(1, 0, 64).tolist() == fresh[2, 1] and s.ids(0, 0, 64).tolist() == fresh[2, 0]
    assert list(s) == fresh[2, 1][8:]


def test_partial_last_global_batch_is_dropped() -> None:
    s = ResumableDistributedSampler(50, 16, 0, 1, seed=0)
    assert s.steps_per_epoch == 3
    assert len(list(s)) == len(s) == 48


def global_stream(
    n: int, gbs: int, world: int, seed: int, steps: int, state: dict | None = None
) -> tuple[list[int], dict]:
    """Consume `steps` optimizer steps at `world` ranks; return the ids in global order and the state."""
    samplers = [ResumableDistributedSampler(n, gbs, r, world, seed) for r in range(world)]
    if state:
        for s in samplers:
            s.load_state_dict(state)
    ids: list[int] = []
    for _ in range(steps):
        if samplers[0].epoch_done:
            for s in samplers:
                s.set_epoch(s.epoch + 1)
        for s in samplers:
            ids.extend(list(s)[: s.per_rank])
            s.advance()
    return ids, samplers[0].state_dict()


@pytest.mark.parametrize(("w1", "w2"), [(2, 1), (1, 2), (4, 2)])
def test_world_size_change_continues_at_the_next_global_sample(w1: int, w2: int) -> None:
    reference, _ = global_stream(80, 8, 1, seed=3, steps=25)  # crosses two epoch boundaries
    first, state = global_stream(80, 8, w1, seed=3, steps=7)
    second, _ = global_stream(80, 8, w2, seed=3, steps=18, state=state)
    assert first + second == reference


def test_bad_sizes_are_data_errors() -> None:
    with pytest.raises(DataError, match="fewer than one global batch"):
        ResumableDistributedSampler(10, 16, 0, 1, seed=0)
    s = ResumableDistributedSampler(64, 8, 0, 1, seed=0)
    with pytest.raises(DataError, match="global_batch_size changed"):
        s.load_state_dict({"epoch": 0, "position": 12, "seed": 0})
