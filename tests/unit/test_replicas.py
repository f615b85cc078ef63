"""The replica digest (observe/digest.py) and the replica check's verdict (train/replicas.py), without processes.

The digest's promise: equal states give equal digests (whatever the copy, the device's order of
addition), and a single flipped bit anywhere changes the tensor's digest and the combined one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.dist import DistContext
from ddptrain.observe.digest import CHUNK, combine, named_state, state_digests, tensor_digest
from ddptrain.review.verdict import verdict
from ddptrain.train.replicas import (
    ReplicaCheck,
    Split,
    name_tensors,
    replica_groups,
    splits,
    verdict_line,
    write_forensics,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]


def random_state(seed: int, sizes: list[int], dtypes: list[torch.dtype]) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, dtype) in enumerate(zip(sizes, dtypes)):
        raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
        out.append((f"t{i}", raw.view(dtype)))
    return out


def flipped(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    raw = t.clone().view(torch.uint8)
    raw[byte] ^= 1 << bit
    return raw.view(t.dtype)


state_shape = st.lists(st.tuples(st.integers(1, 300), st.sampled_from(DTYPES)), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**31), state_shape, st.data())
def test_equal_states_agree_and_any_single_bit_flip_is_seen(seed: int, shape: list, data: st.DataObject) -> None:
    state = random_state(seed, [n for n, _ in shape], [d for _, d in shape])
    digests = state_digests(state, torch.device("cpu"))
    copy = [(name, t.clone()) for name, t in state]
    assert torch.equal(state_digests(copy, torch.device("cpu")), digests)
    which = data.draw(st.integers(0, len(state) - 1))
    name, t = state[which]
    byte = data.draw(st.integers(0, t.numel() * t.element_size() - 1))
    bit = data.draw(st.integers(0, 7))
    changed = list(state)
    changed[which] = (name, flipped(t, byte, bit))
    after = state_digests(changed, torch.device("cpu"))
    assert [i for i in range(len(state)) if after[i] != digests[i]] == [which]
    assert combine(after) != combine(digests)


def test_a_flip_past_the_first_chunk_and_in_a_non_contiguous_tensor_is_seen() -> None:
    big = torch.randn(CHUNK + 5, generator=torch.Generator().manual_seed(1))
    before = tensor_digest(big)
    assert not torch.equal(tensor_digest(flipped(big, 4 * (CHUNK + 3), 0)), before)
    assert torch.equal(tensor_digest(big.clone()), before)
    wide = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(tensor_digest(wide.t()), tensor_digest(wide.t().contiguous()))


def test_named_state_covers_parameters_and_optimizer_state() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    names = [n for n, _ in named_state(model, optimizer)]
    assert names[:2] == ["param:weight", "param:bias"]
    assert {"optim:weight.exp_avg", "optim:weight.exp_avg_sq", "optim:bias.step"} <= set(names)


def test_replica_groups_by_strategy() -> None:
    assert replica_groups(3, "ddp", 1) == [[0, 1, 2]]
    assert replica_groups(4, "hsdp", 2) == [[0, 2], [1, 3]]  # the ranks holding the same shard
    assert replica_groups(4, "fsdp", 1) == []  # no replicas
    assert replica_groups(1, "ddp", 1) == []


def test_a_majority_names_the_odd_rank_and_a_tie_names_every_rank() -> None:
    assert splits([7, 7, 7], [[0, 1, 2]]) == []
    [split] = splits([7, 9, 7], [[0, 1, 2]])
    assert (split.odd, split.majority) == ([1], [0, 2])
    [tie] = splits([7, 9], [[0, 1]])
    assert (tie.odd, tie.majority) == ([0, 1], [])
    [half] = splits([1, 1, 2, 2], [[0, 1, 2, 3]])  # 2 against 2: no majority either
    assert half.odd == [0, 1, 2, 3]
    assert [s.group for s in splits([5, 6, 5, 8], [[0, 2], [1, 3]])] == [[1, 3]]  # HSDP: per shard


def test_the_second_round_names_the_tensors_and_the_line_the_hosts() -> None:
    names = ["param:w", "param:b", "optim:w.exp_avg"]
    per_rank = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    split = Split([0, 1, 2], [1], [0, 2])
    name_tensors(split, per_rank, names)
    assert split.tensors == {1: ["optim:w.exp_avg"]}
    line = verdict_line(split, 30, 25, ("a", "b", "c"))
    assert line.startswith(
        "replicas diverged by step 30 (they agreed at step 25): rank 1 on b differs from the majority"
    )
    assert "(rank 0 on a, 2 on c), in optim:w.exp_avg;" in line
    tie = Split([0, 1], [0, 1])
    name_tensors(tie, [[1, 2], [1, 5]], ["param:w", "param:b"])
    assert tie.tensors == {0: ["param:b"], 1: ["param:b"]}
    assert (
        "ranks 0 on a, 1 on b differ, in param:b; with no majority which one is wrong cannot be told: the last"
        in verdict_line(tie, 10, None, ("a", "b"))
    )


def test_check_steps_are_logged_steps_at_or_after_each_multiple() -> None:
    check = ReplicaCheck(DistContext(world_size=2), 10, [[0, 1]])
    logged = {4, 8, 12, 16, 20, 24}
    assert [s for s in range(1, 25) if check.due(s, s in logged)] == [12, 20]
    assert not ReplicaCheck(DistContext(world_size=2), 0, [[0, 1]]).due(20, True)  # 0: off


def test_triage_prints_a_recorded_divergence(tmp_path: Path) -> None:
    record = {"event": "replica_divergence", "step": 30, "verdict": "replicas diverged by step 30 (...)"}
    write_forensics(tmp_path / "stacks", record)
    assert verdict(tmp_path / "stacks").splitlines()[0] == "verdict: replicas diverged by step 30 (...)"
