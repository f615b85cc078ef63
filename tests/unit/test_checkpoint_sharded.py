"""The sharded checkpoint format: the partition, save/load at any world size, and its verification failures."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.checkpoint import Checkpointer, verify_checkpoint
from ddptrain.checkpoint.digests import DEFAULT_HASH, new_hasher
from ddptrain.checkpoint.exchange import allocate, describe, flatten, rebuild
from ddptrain.checkpoint.formats.sharded import STRUCTURE, ShardedWriter, part_name, partition
from ddptrain.checkpoint.manifest import FileEntry, Manifest, manifest_checksum
from ddptrain.checkpoint.verify import VerifiedCheckpoint
from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
from ddptrain.errors import CheckpointError


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1 << 40), max_size=60), st.integers(1, 16))
def test_partition_puts_every_tensor_in_exactly_one_part_deterministically(sizes: list[int], parts: int) -> None:
    split = partition(sizes, parts)
    assert len(split) == parts
    assert sorted(i for part in split for i in part) == list(range(len(sizes)))
    assert split == partition(list(sizes), parts)  # every rank computes the same split from its own copy
    loads = [sum(sizes[i] for i in part) for part in split]
    # Largest first onto the least loaded part: no part exceeds another by more than the largest tensor.
    assert max(loads) - min(loads) <= max(sizes, default=0)


def shared_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model: OrderedDict[str, torch.Tensor] = OrderedDict(
        (f"layer{i}.weight", torch.randn(8 * (i + 1), 16, generator=g)) for i in range(5)
    )
    model["half"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    model["empty"] = torch.zeros(0, 4)
    model._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    optimizer = {
        "state": {i: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(7, generator=g)} for i in range(3)},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1, 2]}],
    }
    return {"model": model, "optimizer": optimizer, "trainer": {"step": seed, "flags": (1, "a", None)}}


def save_as_ranks(folder: Path, world: int, seed: int, step: int = 1) -> VerifiedCheckpoint:
    """What `world` ranks of one save write (each rank its share), committed by hand: a plain folder + manifest."""
    writer = ShardedWriter()
    folder.mkdir(parents=True)
    files: dict[str, FileEntry] = {}
    for rank in range(world):
        files |= writer.write(folder, rank, world, shared_state(seed), {"rng": {"rank": rank}}, DEFAULT_HASH)
    manifest = Manifest(step, world, "t" * 32, writer.name, 0.0, files, {}, {}, DEFAULT_HASH)
    (folder / "manifest.json").write_bytes(manifest.to_bytes())
    return verify_checkpoint(folder)


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("world", [1, 2, 3])
def test_any_world_size_reads_any_partition(tmp_path: Path, world: int) -> None:
    ckpt = save_as_ranks(tmp_path / "step-00000001", world, seed=4)
    assert {part_name(p, 2 * world) for p in range(2 * world)} <= set(ckpt.manifest.files)  # two parts a rank
    for reader_world in (1, 2, 5):
        shared, local = ShardedWriter().read(ckpt, 0, reader_world)
        assert_same(shared, shared_state(4))
        assert shared["model"]._metadata == {"": {"version": 1}}  # load_state_dict's versions survive
        assert local == ({"rng": {"rank": 0}} if reader_world == world else None)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_shared_load_plan_gives_every_file_one_reader_and_every_rank_a_fair_share(tmp_path: Path, world: int) -> None:
    ckpt = save_as_ranks(tmp_path / "step-00000001", world, seed=4)
    sizes = {name: entry.size for name, entry in ckpt.manifest.files.items()}
    for reader_world in (1, 2, 5):
        plan = ShardedWriter().load_plan(ckpt.manifest, reader_world)
        reads = [plan.reads(r) for r in range(reader_world)]
        assert sorted(n for names in reads for n in names) == sorted(sizes)  # every file read once, by one rank
        rng = {f"rng-rank{r}.pt" for r in range(world)}
        assert plan.private == (rng if reader_world == world else set())  # a rank's own RNG stays with it
        assert plan.shared == set(sizes) - rng  # structure and parts reach every rank; other RNGs no one
        if reader_world == world:
            assert all(f"rng-rank{r}.pt" in plan.keeps(r) for r in range(world))
        spread = [sum(sizes[n] for n in names if n not in plan.private) for names in reads]
        assert max(spread) - min(spread) <= max(sizes.values())  # the greedy partition, over files
        for name in plan.shared:  # what travels: the decoded content, rebuilt from its buffers
            structure, buffers = flatten(ckpt.content(name))
            assert_same(rebuild(structure, buffers), ckpt.content(name))
            assert [tuple(b.shape) for b in allocate(describe(buffers)) if isinstance(b, torch.Tensor)] == [
                tuple(b.shape) for b in buffers if isinstance(b, torch.Tensor)
            ]


@pytest.mark.parametrize("nodes", [(0, 0), (0, 0, 1, 1), (0, 0, 1), (0, 1, 1, 2), (0, 1, 0, 1)])
def test_a_plan_by_node_reads_each_file_on_one_node_and_sends_each_rank_what_it_lacks(
    tmp_path: Path, nodes: tuple[int, ...]
) -> None:
    ckpt = save_as_ranks(tmp_path / "step-00000001", 2, seed=4)
    sizes = {name: entry.size for name, entry in ckpt.manifest.files.items()}
    plan = ShardedWriter().load_plan(ckpt.manifest, len(nodes), nodes)
    read_on = {n: {nodes[r] for r in range(len(nodes)) if n in plan.reads(r)} for n in sizes}
    assert all(len(on) == 1 for on in read_on.values())  # storage reads every byte once, on one node
    per_node = [sum(sizes[n] for n, on in read_on.items() if on == {node}) for node in sorted(set(nodes))]
    assert max(per_node) - min(per_node) <= max(sizes.values())  # the greedy partition, over nodes
    for name in plan.shared:  # each rank of the reading node reads (and verifies) a shared file itself
        (node,) = read_on[name]
        assert {r for r in range(len(nodes)) if name in plan.reads(r)} == {r for r, m in enumerate(nodes) if m == node}
    routes = plan.routes()
    got = {(name, dst) for name, _, dst in routes}
    assert len(got) == len(routes)  # nothing arrives twice
    for rank in range(len(nodes)):  # every rank ends up with every shared content, read or received
        assert {n for n in plan.shared if (n, rank) in got} | set(plan.keeps(rank)) >= plan.shared
        assert not {n for n in plan.shared if (n, rank) in got} & set(plan.reads(rank))
    assert all(src in plan.readers[name] and nodes[src] != nodes[dst] for name, src, dst in routes)
    senders = {src for _, src, _ in routes}
    assert len(set(nodes)) == 1 or len(senders) >= min(nodes.count(m) for m in set(nodes))  # the work is shared
    if len(set(nodes)) == 1:
        assert routes == []  # one host: nothing travels


def test_checkpointer_saves_sharded_by_default_sync_equals_async(tmp_path: Path) -> None:
    for mode in (False, True):
        c = Checkpointer(CkptConfig(async_save=mode), tmp_path / str(mode), DistContext(), {})
        c.setup()
        c.save(3, shared_state(3), {"rng": {"x": torch.arange(3)}})
        c.wait()
        (result,) = c.finished()
        assert result.ok, result.error
        ckpt = verify_checkpoint(tmp_path / str(mode) / "checkpoints" / "step-00000003")
        assert ckpt.manifest.writer == "sharded"
        assert_same(ckpt.state("model"), shared_state(3)["model"])
        shared, local = c.read(ckpt)
        assert_same(shared, shared_state(3))
        assert local is not None and torch.equal(local["rng"]["x"], torch.arange(3))


def flip_byte(folder: Path, name: str, offset: int) -> None:
    data = bytearray((folder / name).read_bytes())
    data[offset] ^= 0x01
    (folder / name).write_bytes(bytes(data))


def test_a_flipped_byte_in_one_ranks_part_is_rejected(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000001"
    save_as_ranks(folder, 2, seed=1)
    flip_byte(folder, part_name(3, 4), (folder / part_name(3, 4)).stat().st_size - 3)  # rank 1's, in a tensor
    with pytest.raises(CheckpointError, match=r"tensors-3-of-4.bin does not match its BLAKE3"):
        verify_checkpoint(folder)
    flip_byte(folder, part_name(3, 4), 1)  # now also in the magic: still reported as corruption, not a parse error
    with pytest.raises(CheckpointError, match=r"tensors-3-of-4.bin does not match its BLAKE3"):
        verify_checkpoint(folder)


def test_a_missing_part_is_rejected(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000001"
    save_as_ranks(folder, 2, seed=1)
    (folder / part_name(0, 4)).unlink()
    with pytest.raises(CheckpointError, match=r"step-00000001: file tensors-0-of-4.bin is missing"):
        verify_checkpoint(folder)
    fields = json.loads((folder / "manifest.json").read_text())
    del fields["files"][part_name(0, 4)]
    fields["checksum"] = manifest_checksum(fields)
    (folder / "manifest.json").write_text(json.dumps(fields))
    with pytest.raises(CheckpointError, match=r"does not list tensors-0-of-4.bin"):
        verify_checkpoint(folder)


def test_a_part_from_another_checkpoint_is_rejected(tmp_path: Path) -> None:
    mine, other = tmp_path / "step-00000001", tmp_path / "step-00000002"
    save_as_ranks(mine, 2, seed=1, step=1)
    save_as_ranks(other, 2, seed=2, step=2)  # same shapes, so the same sizes: only the hash tells them apart
    assert (mine / part_name(3, 4)).stat().st_size == (other / part_name(3, 4)).stat().st_size
    (mine / part_name(3, 4)).unlink()
    shutil.copy(other / part_name(3, 4), mine / part_name(3, 4))
    with pytest.raises(CheckpointError, match=r"tensors-3-of-4.bin does not match its BLAKE3"):
        verify_checkpoint(mine)


def test_a_swapped_part_after_verification_never_reaches_another_ranks_state(tmp_path: Path) -> None:
    mine, other = tmp_path / "step-00000001", tmp_path / "step-00000002"
    ckpt = save_as_ranks(mine, 2, seed=1, step=1)
    save_as_ranks(other, 2, seed=2, step=2)
    named_only = VerifiedCheckpoint(mine, ckpt.manifest)  # another rank receives path + manifest from rank 0
    (mine / part_name(0, 4)).unlink()
    shutil.copy(other / part_name(0, 4), mine / part_name(0, 4))
    assert_same(ckpt.state("model"), shared_state(1)["model"])  # rank 0 holds what it verified
    with pytest.raises(CheckpointError, match="changed after it was verified.*tensors-0-of-4.bin does not match"):
        ShardedWriter().read(named_only, 1, 2)


def test_a_consistent_but_wrong_part_header_is_refused_without_allocating(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000001"
    ckpt = save_as_ranks(folder, 1, seed=1)
    # A part re-hashed into a new manifest (a bug, not corruption): its header claims a huge tensor.
    name = part_name(0, 2)
    data = (folder / name).read_bytes()
    n = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + n])
    header["tensors"][0][2] = [1 << 40]
    blob = json.dumps(header, separators=(",", ":")).encode()
    (folder / name).write_bytes(data[:8] + len(blob).to_bytes(8, "little") + blob + data[16 + n :])
    files = dict(ckpt.manifest.files)
    m = ckpt.manifest
    hasher = new_hasher(m.hash)
    hasher.update((folder / name).read_bytes())
    files[name] = FileEntry(hasher.hexdigest(), (folder / name).stat().st_size)
    (folder / "manifest.json").write_bytes(
        Manifest(m.step, 1, m.timeline, m.writer, 0.0, files, {}, {}, m.hash).to_bytes()
    )
    with pytest.raises(CheckpointError, match=r"tensors-0-of-2.bin cannot be loaded .*the header describes"):
        verify_checkpoint(folder)
    assert STRUCTURE in ckpt.manifest.files
