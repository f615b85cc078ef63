"""Transactional checkpoint folders: manifest verification, fallback, keep, async == sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddptrain.checkpoint import Checkpointer, committed_checkpoints, load_file, verify_checkpoint
from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
from ddptrain.errors import CheckpointError


def make(run_dir: Path, **cfg: object) -> Checkpointer:
    return Checkpointer(CkptConfig(**cfg), run_dir, DistContext(), {"note": "test"})


def state(step: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(step)
    shared = {"model": {"w": torch.randn(64, 64, generator=g)}, "trainer": {"step": step}}
    return shared, {"rng": {"torch": torch.get_rng_state()}}


def save_steps(ckpt: Checkpointer, steps: list[int]) -> None:
    for s in steps:
        ckpt.save(s, *state(s))
        ckpt.wait()
        assert all(r.ok for r in ckpt.finished())


def test_commit_layout_and_manifest(tmp_path: Path) -> None:
    save_steps(make(tmp_path), [5])
    folder = tmp_path / "checkpoints" / "step-00000005"
    manifest = verify_checkpoint(folder)
    assert manifest["step"] == 5 and manifest["world_size"] == 1 and manifest["config"] == {"note": "test"}
    assert set(manifest["files"]) == {"model.pt", "trainer.pt", "rng-rank0.pt"}
    assert torch.equal(load_file(folder, "model.pt")["w"], state(5)[0]["model"]["w"])
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_keep_k_after_many_saves(tmp_path: Path) -> None:
    save_steps(make(tmp_path, keep=2), list(range(1, 9)))
    assert [p.name for p in committed_checkpoints(tmp_path / "checkpoints")] == ["step-00000008", "step-00000007"]


def corrupt_truncate(folder: Path) -> None:
    f = folder / "model.pt"
    f.write_bytes(f.read_bytes()[:-100])


def corrupt_flip_one_bit(folder: Path) -> None:
    f = folder / "model.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def corrupt_delete_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()


def corrupt_delete_file(folder: Path) -> None:
    (folder / "rng-rank0.pt").unlink()


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (corrupt_truncate, "model.pt has"),
        (corrupt_flip_one_bit, "model.pt does not match its SHA-256"),
        (corrupt_delete_manifest, "manifest.json is missing"),
        (corrupt_delete_file, "rng-rank0.pt is missing"),
    ],
)
def test_bad_newest_falls_back_with_a_warning(tmp_path: Path, corrupt, reason: str) -> None:  # type: ignore[no-untyped-def]
    ckpt = make(tmp_path)
    save_steps(ckpt, [3, 6])
    corrupt(tmp_path / "checkpoints" / "step-00000006")
    warnings: list[str] = []
    found = ckpt.find_resume(warnings.append)
    assert found is not None and found[0].name == "step-00000003"
    assert len(warnings) == 1 and "step-00000006" in warnings[0] and reason in warnings[0]


def test_all_bad_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    save_steps(ckpt, [3, 6])
    corrupt_flip_one_bit(tmp_path / "checkpoints" / "step-00000003")
    corrupt_truncate(tmp_path / "checkpoints" / "step-00000006")
    with pytest.raises(CheckpointError, match="all 2 checkpoint"):
        ckpt.find_resume(lambda _: None)


def test_resume_modes(tmp_path: Path) -> None:
    save_steps(make(tmp_path), [3, 6])
    assert make(tmp_path, resume="never").find_resume(print) is None
    path = tmp_path / "checkpoints" / "step-00000003"
    found = make(tmp_path, resume=str(path)).find_resume(print)
    assert found is not None and found[0] == path
    corrupt_flip_one_bit(path)
    with pytest.raises(CheckpointError, match="SHA-256"):
        make(tmp_path, resume=str(path)).find_resume(print)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        make(tmp_path, resume=str(tmp_path / "nope")).find_resume(print)
    assert make(tmp_path / "empty").find_resume(print) is None  # nothing saved yet: a fresh start


def test_async_writes_the_same_state_as_sync(tmp_path: Path) -> None:
    shared, local = state(4)
    sync, asyn = make(tmp_path / "s"), make(tmp_path / "a", **{"async": True})
    sync.save(4, shared, local)
    asyn.save(4, shared, local)
    shared["model"]["w"].add_(1.0)  # the loop goes on mutating its tensors: the snapshot must not see it
    asyn.wait()
    (rs,), (ra,) = sync.finished(), asyn.finished()
    assert rs.ok and ra.ok and ra.blocked_s <= ra.total_s
    a = json.loads((ra.path / "manifest.json").read_text())["files"]
    s = json.loads((rs.path / "manifest.json").read_text())["files"]
    assert a == s  # byte-identical files


def test_stale_temporary_folder_is_removed_and_never_listed(tmp_path: Path) -> None:
    stale = tmp_path / "checkpoints" / ".tmp-step-00000009"
    stale.mkdir(parents=True)
    (stale / "model.pt").write_bytes(b"partial")
    assert committed_checkpoints(tmp_path / "checkpoints") == []
    make(tmp_path)
    assert not stale.exists()
