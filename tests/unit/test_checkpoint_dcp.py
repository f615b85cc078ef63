"""The dcp format's manifest and verification pieces, in one process (DCP without a process group)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ddptrain.checkpoint import verify_checkpoint
from ddptrain.checkpoint.digests import DEFAULT_HASH, HASHES, new_hasher
from ddptrain.checkpoint.formats.dcp import DcpWriter, HashingFiles, load_sharded
from ddptrain.checkpoint.manifest import DCP_METADATA, FileEntry, Manifest, disk_name, is_plain_name
from ddptrain.checkpoint.verify import VerifiedCheckpoint
from ddptrain.errors import CheckpointError


def test_dcp_metadata_is_listed_under_a_plain_name_mapped_to_its_hidden_file() -> None:
    assert not is_plain_name(".metadata")  # hidden names stay refused as manifest entries
    assert is_plain_name(DCP_METADATA) and disk_name(DCP_METADATA) == ".metadata"
    assert disk_name("__0_0.distcp") == "__0_0.distcp"


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(6, 4, generator=g), "b.bias": torch.randn(5, generator=g)}


def save(folder: Path, model: dict[str, torch.Tensor] | None = None) -> VerifiedCheckpoint:
    """What one rank's dcp save writes (model_state() unless given), committed by hand (plain folder + manifest)."""
    folder.mkdir(parents=True)
    writer = DcpWriter()
    shared: dict[str, Any] = {
        "model": model_state() if model is None else model,
        "optimizer": {},
        "trainer": {"step": 1},
    }
    files: dict[str, FileEntry] = writer.write(folder, 0, 1, shared, {"rng": {"rank": 0}}, DEFAULT_HASH)
    assert {DCP_METADATA, "__0_0.distcp", "trainer.pt", "rng-rank0.pt"} <= files.keys()
    manifest = Manifest(1, 1, "t" * 32, writer.name, 0.0, files, {}, {}, DEFAULT_HASH)
    (folder / "manifest.json").write_bytes(manifest.to_bytes())
    return verify_checkpoint(folder)


def test_a_dcp_checkpoint_consolidates_exactly_in_one_process(tmp_path: Path) -> None:
    ckpt = save(tmp_path / "step")
    got = ckpt.state("model")
    assert got.keys() == model_state().keys()
    assert all(torch.equal(got[k], v) for k, v in model_state().items())
    assert ckpt.state("trainer") == {"step": 1}


def test_dcp_saves_with_cached_plans_hold_each_saves_own_state(tmp_path: Path) -> None:
    # DCP's plans are cached across saves in a process: the same shapes reuse them (with the new values), a
    # changed state is planned again, and going back to the first shapes still writes what is saved now.
    g = torch.Generator().manual_seed(4)
    states = [
        model_state(),
        {"a.weight": torch.randn(3, 3, generator=g), "c.weight": torch.randn(7, generator=g)},
        {k: v + 1 for k, v in model_state().items()},
        {k: v * 2 for k, v in model_state().items()},
    ]
    for i, state in enumerate(states):
        got = save(tmp_path / str(i) / "step", state).state("model")
        assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_flipped_byte_in_a_dcp_file_is_named_and_rejected(tmp_path: Path, name: str) -> None:
    save(tmp_path / "step")
    path = tmp_path / "step" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"file {name}.* does not match its BLAKE3"):
        verify_checkpoint(tmp_path / "step")


def test_dcp_reads_the_verified_bytes_not_the_file_rewritten_after_verification(tmp_path: Path) -> None:
    ckpt = save(tmp_path / "step")
    shard = tmp_path / "step" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # zeros, same size: what a swap after verify would do
    state: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in model_state().items()}}
    load_sharded(ckpt, state, None)
    assert all(torch.equal(state["model"][k], v) for k, v in model_state().items())


# Every file opened for reading under WATCHED[0] while it is set (an audit hook sees each open() and
# os.open() in this process, DCP's and torch's included; hooks cannot be removed, so it stays gated).
WATCHED: list[Path] = []
READ_OPENS: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not WATCHED or isinstance(args[0], int):
        return
    path, _mode, flags = args
    if Path(os.fsdecode(path)).parent == WATCHED[0] and flags & os.O_ACCMODE != os.O_WRONLY:
        READ_OPENS.append(Path(os.fsdecode(path)).name)


sys.addaudithook(_audit)


@pytest.mark.parametrize("algorithm", HASHES)
def test_dcp_files_are_hashed_as_written_and_never_read_back(tmp_path: Path, algorithm: str) -> None:
    folder = tmp_path / "step"
    folder.mkdir()
    shared: dict[str, Any] = {"model": model_state(), "optimizer": {}, "trainer": {"step": 1}}
    READ_OPENS.clear()
    WATCHED.append(folder)
    try:
        files = DcpWriter().write(folder, 0, 1, shared, {"rng": {"rank": 0}}, algorithm)
    finally:
        WATCHED.clear()
    assert READ_OPENS == []  # the save hashed the bytes on their way out
    on_disk = {DCP_METADATA if p.name == ".metadata" else p.name: p for p in folder.iterdir()}
    assert files.keys() == on_disk.keys()  # every file the save left is listed (no stray .metadata.tmp)
    for name, path in on_disk.items():
        hasher = new_hasher(algorithm)
        hasher.update(path.read_bytes())
        assert files[name] == FileEntry(hasher.hexdigest(), path.stat().st_size), name


def test_the_hashing_file_system_refuses_to_read_during_a_save(tmp_path: Path) -> None:
    (tmp_path / "x.distcp").write_bytes(b"abc")
    fs = HashingFiles(DEFAULT_HASH)
    with pytest.raises(CheckpointError, match=r"DCP asked to open x.distcp with mode 'rb' during a save"):
        with fs.create_stream(tmp_path / "x.distcp", "rb"):
            pass
    with pytest.raises(FileExistsError):  # a save only creates new files: never through an existing name
        with fs.create_stream(tmp_path / "x.distcp", "wb"):
            pass
    with pytest.raises(CheckpointError, match="DCP wrote y.distcp without hashing it"):
        fs.entry("y.distcp")
