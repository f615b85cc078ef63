"""Checkpoint faults end to end: disk full, a failing rank, corrupt checkpoints on resume, export."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, run_ddptrain
from safetensors.torch import load_file as load_safetensors

from ddptrain.checkpoint import verify_checkpoint
from ddptrain.config import ModelConfig
from ddptrain.models.gpt import GPT

pytestmark = pytest.mark.dist


def committed(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


@pytest.mark.timeout(180)
def test_one_rank_failing_to_write_commits_nothing_and_keeps_the_old(tiny_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run_ddptrain(["train", *tiny_args, "train.max_steps=3"], nproc=2)
    assert first.returncode == 0, first.stderr
    # 50 KB per file: the RNG files fit, each rank's share of the tensors does not (EFBIG).
    failed = run_ddptrain(["train", *tiny_args], nproc=2, max_file_bytes=50_000)
    assert failed.returncode != 0
    assert "checkpoint at step 6 was not committed: rank 0" in failed.stderr  # an error: stderr
    assert "File too large" in failed.stderr and "earlier checkpoints are kept" in failed.stderr
    assert committed(run_dir) == ["step-00000003"]
    verify_checkpoint(run_dir / "checkpoints" / "step-00000003")
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))

    goes_on = run_ddptrain(
        ["train", *tiny_args, "train.max_steps=9", "ckpt.on_error=continue"], nproc=2, max_file_bytes=50_000
    )
    # It trains on, retries the final save once, and then says the final state is lost: never exit 0.
    assert goes_on.returncode == 1, goes_on.stderr
    assert "retrying the save of step 9" in goes_on.stderr
    assert "the final state at step 9 could not be committed" in goes_on.stderr
    assert "the newest safe checkpoint is step 3" in goes_on.stderr
    failures = [e for e in read_metrics(run_dir, "event") if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failures] == [6, 6, 9, 9]  # the stopped run's, then this run's three
    assert max(m["step"] for m in read_metrics(run_dir)) == 9
    assert committed(run_dir) == ["step-00000003"]
    verify_checkpoint(run_dir / "checkpoints" / "step-00000003")


@pytest.fixture
def small_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=450k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): the disk-full test needs a small filesystem")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(120)
def test_disk_full_on_save(tiny_args: list[str], small_tmpfs: Path) -> None:
    run_dir = small_tmpfs / "run"
    # One checkpoint of the tiny model (~290 KB) fits in 450 KB; a second cannot be written.
    result = run_ddptrain(["train", *tiny_args, f"run.dir={run_dir}", "ckpt.every_steps=2"])
    assert result.returncode == 1
    assert "checkpoint at step 4 was not committed" in result.stderr and "No space left on device" in result.stderr
    assert committed(run_dir) == ["step-00000002"]
    verify_checkpoint(run_dir / "checkpoints" / "step-00000002")


@pytest.mark.timeout(120)
def test_on_error_continue_on_a_full_disk_never_loses_the_final_state_quietly(
    tiny_args: list[str], small_tmpfs: Path
) -> None:
    run_dir = small_tmpfs / "run"
    result = run_ddptrain(["train", *tiny_args, f"run.dir={run_dir}", "ckpt.every_steps=2", "ckpt.on_error=continue"])
    assert result.returncode == 1, result.stderr
    final = [line for line in result.stderr.splitlines() if "could not be committed" in line]
    assert len(final) == 1 and "the newest safe checkpoint is step 2" in final[0], result.stderr
    assert "done:" not in result.stdout
    assert committed(run_dir) == ["step-00000002"]
    verify_checkpoint(run_dir / "checkpoints" / "step-00000002")


@pytest.mark.timeout(180)
def test_resume_falls_back_past_a_corrupt_checkpoint_and_refuses_all_bad(tiny_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_ddptrain(["train", *tiny_args]).returncode == 0
    newest = run_dir / "checkpoints" / "step-00000006" / "tensors-0-of-2.bin"  # one of its two parts
    data = bytearray(newest.read_bytes())
    data[1000] ^= 0x10
    newest.write_bytes(bytes(data))
    again = run_ddptrain(["train", *tiny_args, "train.max_steps=7"])
    assert again.returncode == 0, again.stderr
    assert "checkpoint rejected: step-00000006: file tensors-0-of-2.bin does not match its BLAKE3" in again.stderr
    assert "resuming from" in again.stdout and "step-00000003 (step 3" in again.stdout

    for folder in (run_dir / "checkpoints").glob("step-*"):
        (folder / "manifest.json").unlink()
    refused = run_ddptrain(["train", *tiny_args, "train.max_steps=9"])
    assert refused.returncode == 2
    assert "failed verification; refusing to start over silently" in refused.stderr
    # One error line; before it, on stderr too, one warning per checkpoint tried, naming why it was rejected.
    lines = refused.stderr.strip().splitlines()
    assert [line for line in lines if ": error: " in line] == lines[-1:], refused.stderr
    assert all(line.startswith("warning: checkpoint rejected: step-") for line in lines[:-1]), refused.stderr


@pytest.mark.timeout(120)
def test_export_to_safetensors_loads_without_the_trainer(tiny_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_ddptrain(["train", *tiny_args]).returncode == 0
    out = tmp_path / "export" / "model.safetensors"
    result = run_ddptrain(["export", str(run_dir), "--step", "3", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["step"] == 3
    model = GPT(ModelConfig(**meta["model"]))
    model.load_state_dict(load_safetensors(str(out)))
    reference = verify_checkpoint(run_dir / "checkpoints" / "step-00000003").state("model")
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name
    shutil.rmtree(run_dir / "checkpoints")
    missing = run_ddptrain(["export", str(run_dir), "--out", str(out)])
    assert missing.returncode == 2 and "no committed checkpoint" in missing.stderr
