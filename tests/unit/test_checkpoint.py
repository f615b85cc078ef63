"""Transactional checkpoint folders: manifest verification, fallback, keep, timelines, async == sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env_for_subprocess

from ddptrain.checkpoint import Checkpointer, committed_checkpoints, verify_checkpoint
from ddptrain.checkpoint.formats.rank0_torch import RankZeroTorchWriter
from ddptrain.checkpoint.manifest import manifest_checksum
from ddptrain.checkpoint.verify import VerifiedCheckpoint
from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
from ddptrain.errors import CheckpointError


def make(run_dir: Path, **cfg: object) -> Checkpointer:
    # These tests pin the single-writer format: it must go on loading (the sharded one: test_checkpoint_sharded.py).
    checkpointer = Checkpointer(
        CkptConfig(**cfg), run_dir, DistContext(), {"note": "test"}, writer=RankZeroTorchWriter()
    )
    checkpointer.setup()
    return checkpointer


def state(step: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(step)
    shared = {"model": {"w": torch.randn(64, 64, generator=g)}, "optimizer": {"state": {}}, "trainer": {"step": step}}
    return shared, {"rng": {"torch": torch.get_rng_state()}}


def save_steps(ckpt: Checkpointer, steps: list[int]) -> None:
    for s in steps:
        ckpt.save(s, *state(s))
        ckpt.wait()
        assert all(r.ok for r in ckpt.finished())


def names(run_dir: Path) -> list[str]:
    return [p.name for p in committed_checkpoints(run_dir / "checkpoints")]


def test_commit_layout_and_manifest(tmp_path: Path) -> None:
    save_steps(make(tmp_path), [5])
    folder = tmp_path / "checkpoints" / "step-00000005"
    ckpt = verify_checkpoint(folder)
    assert ckpt.step == 5 and ckpt.manifest.world_size == 1 and ckpt.manifest.config == {"note": "test"}
    assert set(ckpt.manifest.files) == {"model.pt", "optimizer.pt", "trainer.pt", "rng-rank0.pt"}
    assert torch.equal(ckpt.load("model.pt")["w"], state(5)[0]["model"]["w"])
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_keep_k_after_many_saves(tmp_path: Path) -> None:
    save_steps(make(tmp_path, keep=2), list(range(1, 9)))
    assert names(tmp_path) == ["step-00000008", "step-00000007"]


_SAVE_AND_EXIT = """
import sys, torch
from pathlib import Path
from ddptrain.checkpoint import Checkpointer, verify_checkpoint
from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
ckpt = Checkpointer(CkptConfig(keep=2), Path(sys.argv[1]), DistContext(), {})
ckpt.setup()
for step in range(1, 5):
    ckpt.save(step, {"model": {"w": torch.full((256, 256), float(step))}, "optimizer": {}, "trainer": {}}, {"rng": {}})
    (result,) = ckpt.finished()
    assert result.ok and result.path is not None, result.error
    verify_checkpoint(result.path)  # committed and complete when a sync save returns, its prune still running
"""


@pytest.mark.timeout(60)
def test_sync_saves_prune_behind_the_commit_and_finish_before_the_process_ends(tmp_path: Path) -> None:
    # The prune after a commit runs in a thread of its own: the next save waits for it, and a process that
    # ends right after its last save (no wait()) still leaves exactly `keep` checkpoints.
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_AND_EXIT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=50,
        env=env_for_subprocess(),
    )
    assert done.returncode == 0, done.stderr
    assert names(tmp_path) == ["step-00000004", "step-00000003"]
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-00000004").manifest.writer == "sharded"


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


def edit_manifest(folder: Path, change, rechecksum: bool = True) -> None:  # type: ignore[no-untyped-def]
    path = folder / "manifest.json"
    fields = json.loads(path.read_text())
    change(fields)
    if rechecksum:
        fields["checksum"] = manifest_checksum(fields)
    path.write_text(json.dumps(fields))


def flip_world_size_digit(folder: Path) -> None:
    path = folder / "manifest.json"
    path.write_text(path.read_text().replace('"world_size": 1', '"world_size": 3'))


def invalid_utf8(folder: Path) -> None:
    path = folder / "manifest.json"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] = 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (corrupt_truncate, "model.pt has"),
        (corrupt_flip_one_bit, "model.pt does not match its BLAKE3"),
        (corrupt_delete_manifest, "manifest.json is missing"),
        (corrupt_delete_file, "rng-rank0.pt is missing"),
        (flip_world_size_digit, "does not match its own checksum"),
        (invalid_utf8, "not valid UTF-8"),
        (lambda f: edit_manifest(f, lambda m: m.update(files={})), "does not list model.pt"),
        (lambda f: edit_manifest(f, lambda m: m["files"].pop("optimizer.pt")), "does not list optimizer.pt"),
        (lambda f: edit_manifest(f, lambda m: m.update(step="6")), "'step' is a str"),
        (lambda f: edit_manifest(f, lambda m: m.update(world_size=True)), "'world_size' is a bool"),
        (lambda f: edit_manifest(f, lambda m: m.pop("timeline")), "has no 'timeline'"),
        (lambda f: edit_manifest(f, lambda m: m.update(files=[])), "'files' is a list"),
        (lambda f: edit_manifest(f, lambda m: m["files"].update({"model.pt": {"digest": 5, "size": 1}})), "malformed"),
        (lambda f: (f / "manifest.json").write_text("[1, 2]"), "not a JSON object"),
        (lambda f: (f / "manifest.json").write_text('{"format": NaN}'), "not valid JSON"),
        (lambda f: edit_manifest(f, lambda m: m.update(format=1), rechecksum=False), "format 1"),
    ],
)
def test_bad_newest_falls_back_with_a_warning(tmp_path: Path, corrupt, reason: str) -> None:  # type: ignore[no-untyped-def]
    ckpt = make(tmp_path)
    save_steps(ckpt, [3, 6])
    newest = tmp_path / "checkpoints" / "step-00000006"
    corrupt(newest)
    warnings: list[str] = []
    found = make(tmp_path).find_resume(warnings.append)
    assert found is not None and found.checkpoint.path.name == "step-00000003"
    assert "step-00000006" in warnings[0] and reason in warnings[0], warnings
    # the rejected newer folder is moved aside, never deleted, never resumed by a later run
    assert names(tmp_path) == ["step-00000003"]
    archived = list((tmp_path / "checkpoints" / "archive").glob("*/step-00000006"))
    assert len(archived) == 1 and "moved to" in warnings[-1]


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", "sub/model.pt", "..", ".hidden", "a\x00b"])
def test_names_outside_the_folder_are_rejected_without_touching_them(tmp_path: Path, name: str) -> None:
    save_steps(make(tmp_path), [3, 6])
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 1234)
    newest = tmp_path / "checkpoints" / "step-00000006"
    edit_manifest(newest, lambda m: m["files"].update({name: {"digest": "0" * 64, "size": 1234}}))
    with pytest.raises(CheckpointError, match="not a plain file name") as e:
        verify_checkpoint(newest)
    assert "1234" not in str(e.value)  # no other file's size leaks


def test_a_listed_file_that_is_a_symlink_is_rejected(tmp_path: Path) -> None:
    save_steps(make(tmp_path), [3])
    folder = tmp_path / "checkpoints" / "step-00000003"
    target = tmp_path / "elsewhere.pt"
    os.rename(folder / "model.pt", target)
    (folder / "model.pt").symlink_to(target)  # same bytes, but through a link: refused
    with pytest.raises(CheckpointError, match="model.pt is not a readable regular file"):
        verify_checkpoint(folder)


def test_load_refuses_unlisted_files_and_bytes_changed_after_verification(tmp_path: Path) -> None:
    save_steps(make(tmp_path), [3])
    folder = tmp_path / "checkpoints" / "step-00000003"
    ckpt = verify_checkpoint(folder)
    torch.save({"evil": 1}, folder / "extra.pt")
    with pytest.raises(CheckpointError, match="not listed"):
        ckpt.load("extra.pt")
    named_only = VerifiedCheckpoint(folder, ckpt.manifest)  # what another rank receives: it reads the files itself
    corrupt_flip_one_bit(folder)
    # The verified checkpoint holds the bytes it verified: a later change cannot reach the state.
    assert torch.equal(ckpt.load("model.pt")["w"], state(3)[0]["model"]["w"])
    with pytest.raises(CheckpointError, match="changed after it was verified.*model.pt does not match its BLAKE3"):
        named_only.load("model.pt")


def test_all_bad_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    save_steps(ckpt, [3, 6])
    corrupt_flip_one_bit(tmp_path / "checkpoints" / "step-00000003")
    corrupt_truncate(tmp_path / "checkpoints" / "step-00000006")
    with pytest.raises(CheckpointError, match="all 2 checkpoint"):
        make(tmp_path).find_resume(lambda _: None)
    assert names(tmp_path) == ["step-00000006", "step-00000003"]  # nothing moved or deleted


def test_resume_modes(tmp_path: Path) -> None:
    save_steps(make(tmp_path), [3, 6])
    path = tmp_path / "checkpoints" / "step-00000003"
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        make(tmp_path, resume=str(tmp_path / "nope")).find_resume(print)
    corrupt_flip_one_bit(path)
    with pytest.raises(CheckpointError, match="BLAKE3"):
        make(tmp_path, resume=str(path)).find_resume(print)
    assert make(tmp_path / "empty").find_resume(print) is None  # nothing saved yet: a fresh start
    assert make(tmp_path / "empty", resume="never").find_resume(print) is None


def test_resume_never_into_a_folder_with_checkpoints_is_refused_unless_archived(tmp_path: Path) -> None:
    save_steps(make(tmp_path), [2, 4, 6])
    with pytest.raises(
        CheckpointError, match=r"already holds 3 checkpoint\(s\).*run.name=NEW_NAME.*ckpt.existing=archive"
    ):
        make(tmp_path, resume="never").find_resume(print)
    assert names(tmp_path) == ["step-00000006", "step-00000004", "step-00000002"]
    fresh = make(tmp_path, resume="never", existing="archive", keep=3)
    assert fresh.find_resume(print) is None
    save_steps(fresh, [1, 2])
    assert names(tmp_path) == ["step-00000002", "step-00000001"]  # the new run's own, not pruned
    assert len(list((tmp_path / "checkpoints" / "archive").glob("*/step-*"))) == 3
    found = make(tmp_path).find_resume(print)
    assert found is not None and found.checkpoint.step == 2  # never the old run's step 6


def test_pruning_spares_strangers_and_other_timelines(tmp_path: Path) -> None:
    save_steps(make(tmp_path / "other"), [2, 4, 6])
    ours = make(tmp_path, keep=1)
    ours.find_resume(print)
    (tmp_path / "checkpoints" / "step-99999999").mkdir(parents=True)  # an empty stranger
    stranger = tmp_path / "checkpoints" / "step-00000002"
    os.rename(tmp_path / "other" / "checkpoints" / "step-00000002", stranger)  # verified, another timeline
    save_steps(ours, [3, 4, 5])
    assert names(tmp_path) == ["step-99999999", "step-00000005", "step-00000002"]
    verify_checkpoint(stranger)


def test_corrupt_newest_with_keep_1_keeps_the_good_one(tmp_path: Path) -> None:
    save_steps(make(tmp_path, keep=2), [3, 6])
    corrupt_flip_one_bit(tmp_path / "checkpoints" / "step-00000006")
    resumed = make(tmp_path, keep=1)
    found = resumed.find_resume(print)
    assert found is not None and found.checkpoint.step == 3
    save_steps(resumed, [4])
    assert names(tmp_path) == ["step-00000004"]
    verify_checkpoint(tmp_path / "checkpoints" / "step-00000004")


def test_resuming_an_older_checkpoint_never_returns_to_the_abandoned_branch(tmp_path: Path) -> None:
    save_steps(make(tmp_path, keep=5), [3, 6, 9])
    branch = make(tmp_path, resume=str(tmp_path / "checkpoints" / "step-00000003"), keep=5)
    assert branch.find_resume(print) is not None
    save_steps(branch, [4])
    found = make(tmp_path).find_resume(print)
    assert found is not None and found.checkpoint.step == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "archive").glob("*/step-*")) == [
        "step-00000006",
        "step-00000009",
    ]


def test_saves_refuse_planted_links(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step-00000004").symlink_to(victim)  # planted after setup
    ckpt.save(4, *state(4))
    (result,) = ckpt.finished()
    assert not result.ok and "planted" in (result.error or "")
    assert list(victim.iterdir()) == []
    make(tmp_path)  # setup removes the link, not what it points at
    assert victim.is_dir() and not (tmp_path / "checkpoints" / ".tmp-step-00000004").is_symlink()


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


def test_a_checkpoints_folder_that_is_a_link_is_refused_at_start(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        make(tmp_path / "run").find_resume(print)
    assert list(elsewhere.iterdir()) == []
