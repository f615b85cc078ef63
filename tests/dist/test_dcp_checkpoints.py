"""Sharded (DCP) checkpoints of FSDP runs end to end: bit-exact resume after SIGKILL, world-size changes,
corruption of any DCP file, strategy switches across a resume, and export."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, run_ddptrain
from safetensors.torch import load_file as load_safetensors
from test_resume import assert_bit_exact, common, consumed_ids, killable

from ddptrain.checkpoint import verify_checkpoint
from ddptrain.config import ModelConfig
from ddptrain.models.gpt import GPT

pytestmark = pytest.mark.dist

FSDP = "dist.strategy=fsdp"
SMALL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32"]  # two blocks: two FSDP units and the root


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def model_of(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = verify_checkpoint(ckpt(run_dir, step)).state("model")
    return state


@pytest.mark.timeout(120)
def test_fsdp_sigkill_resume_is_bit_exact(corpus_dir: Path, tmp_path: Path) -> None:
    reference, run_dir, marker = tmp_path / "ref", tmp_path / "run", tmp_path / "killed"
    disarmed = tmp_path / "never"
    disarmed.write_text("")
    ref = run_ddptrain(["train", *common(corpus_dir, reference), *killable(disarmed, 1), FSDP], nproc=2)
    assert ref.returncode == 0, ref.stderr
    assert verify_checkpoint(ckpt(reference, 10)).manifest.writer == "dcp"
    # Rank 1 dies at its 2nd micro-batch of step 8: after the step-6 checkpoint, mid accumulation.
    args = ["train", *common(corpus_dir, run_dir), *killable(marker, 7 * 2 + 2, rank=1), FSDP]
    first = run_ddptrain(args, nproc=2)
    assert first.returncode != 0 and marker.exists(), first.stderr
    second = run_ddptrain(args, nproc=2)
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stdout and "step-00000006" in second.stdout
    assert_bit_exact(reference, run_dir)


@pytest.mark.timeout(120)
def test_fsdp_world_size_changes_neither_skip_nor_repeat(tmp_path: Path) -> None:
    """2 ranks to step 3, 1 rank to step 6, 2 ranks to step 9 (100 samples, 6 steps of 16 per epoch):
    epoch 1 (steps 1-6) uses 96 distinct samples, epoch 2 (steps 7-9) 48 more, none twice."""

    def args(run_dir: Path, record: Path, steps: int) -> list[str]:
        return [
            "train",
            "model.target=toy:build_model",
            "data.target=toy:build_datasets",
            f"model.kwargs={{dim: 8, record_dir: {record}}}",
            "data.kwargs={n: 100, dim: 8}",
            f"run.dir={run_dir}",
            f"train.max_steps={steps}",
            "train.global_batch_size=16",
            "data.micro_batch_size=4",
            "train.eval_every=0",
            "ckpt.every_steps=0",
            FSDP,
            "model.shard_units=[Linear]",
        ]

    records, outputs = [], []
    for i, (nproc, steps) in enumerate([(2, 3), (0, 6), (2, 9)]):
        records.append(tmp_path / f"ids-{i}")
        r = run_ddptrain(args(tmp_path / "run", records[-1], steps), nproc=nproc)
        assert r.returncode == 0, r.stderr
        outputs.append(r.stdout)
    assert "saved at world size 2, now 1" in outputs[1] and "saved at world size 1, now 2" in outputs[2]
    got = [consumed_ids(rec) for rec in records]
    assert [len(g) for g in got] == [3 * 16, 3 * 16, 3 * 16]
    epoch1, epoch2 = Counter(got[0] + got[1]), Counter(got[2])
    assert len(epoch1) == 96 and max(epoch1.values()) == 1
    assert len(epoch2) == 48 and max(epoch2.values()) == 1
    events = [m for m in read_metrics(tmp_path / "run", "event") if m["event"] in ("start", "resume")]
    assert [(e["event"], e["world_size"]) for e in events] == [("start", 2), ("resume", 1), ("resume", 2)]
    assert all(verify_checkpoint(p).manifest.writer == "dcp" for p in (tmp_path / "run/checkpoints").glob("step-*"))


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.timeout(120)
def test_a_flipped_byte_in_any_dcp_file_is_rejected(corpus_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Async saves: DCP runs its collectives in the save thread, on the checkpointer's own group.
    base = [
        "train",
        *common(corpus_dir, run_dir),
        *SMALL,
        "ckpt.every_steps=2",
        "ckpt.keep=3",
        "ckpt.async_save=true",
        FSDP,
    ]
    first = run_ddptrain([*base, "train.max_steps=6"], nproc=2)
    assert first.returncode == 0, first.stderr
    six, four = ckpt(run_dir, 6), ckpt(run_dir, 4)
    assert (six / ".metadata").is_file() and (four / "__1_0.distcp").is_file()
    # A complete copy of step 6, manifest included, under a temp name: a save that never committed.
    partial = run_dir / "checkpoints" / ".tmp-step-00000008"
    shutil.copytree(six, partial)
    flip(six / ".metadata", 64)
    flip(four / "__1_0.distcp", (four / "__1_0.distcp").stat().st_size // 2)
    second = run_ddptrain([*base, "train.max_steps=8"], nproc=2)
    assert second.returncode == 0, second.stderr
    out, err = second.stdout, second.stderr  # progress on stdout, warnings on stderr
    assert "step-00000006: file .metadata (listed as dcp.metadata) does not match its BLAKE3" in err
    assert "step-00000004: file __1_0.distcp does not match its BLAKE3" in err
    assert "resuming from" in out and "step-00000002 (step 2" in out
    assert not partial.exists()  # removed at set-up, never loaded
    resumed = [m["step"] for m in read_metrics(run_dir)]
    assert resumed[-6:] == [3, 4, 5, 6, 7, 8]


@pytest.mark.timeout(150)
def test_ddp_to_fsdp_to_ddp_carries_parameters_exactly_and_exports(corpus_dir: Path, tmp_path: Path) -> None:
    """lr 1e-30 after the first run: every update is below half a float32 ulp of every parameter (none is 0),
    so each later checkpoint must hold exactly the first one's parameters, or the switch lost them."""
    run_dir = tmp_path / "run"
    base = ["train", *common(corpus_dir, run_dir), *SMALL, "ckpt.every_steps=0"]
    ddp = run_ddptrain([*base, "train.max_steps=2"], nproc=2)
    assert ddp.returncode == 0, ddp.stderr
    fsdp = run_ddptrain([*base, "train.max_steps=3", "train.lr=1e-30", FSDP], nproc=2)
    assert fsdp.returncode == 0, fsdp.stderr
    back = run_ddptrain([*base, "train.max_steps=4", "train.lr=1e-30"], nproc=2)
    assert back.returncode == 0, back.stderr
    writers = [verify_checkpoint(ckpt(run_dir, s)).manifest.writer for s in (2, 3, 4)]
    assert writers == ["sharded", "dcp", "sharded"]
    saved = model_of(run_dir, 2)
    for step in (3, 4):
        again = model_of(run_dir, step)
        assert again.keys() == saved.keys()
        assert all(torch.equal(again[k], saved[k]) for k in saved), step

    # Export consolidates the DCP checkpoint in one process, from verified bytes.
    out = tmp_path / "export" / "model.safetensors"
    exported = run_ddptrain(["export", str(run_dir), "--step", "3", "--out", str(out)])
    assert exported.returncode == 0, exported.stderr
    meta = json.loads(out.with_suffix(".json").read_text())
    model = GPT(ModelConfig(**meta["model"]))
    model.load_state_dict(load_safetensors(str(out)))
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
