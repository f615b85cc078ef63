"""Compressed gradients on 2 launched gloo ranks: fp16 (DDP's hook, FSDP's reduce dtype) and PowerSGD train (the loss falls, accumulation still skips
the all-reduce of all micro-batches but the last), a PowerSGD run stopped and resumed is bit for bit the
uninterrupted one (each rank's error feedback is in the checkpoint) and verify-resume agrees, bf16 is refused on
gloo before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import cached_run, final_model_state, read_metrics, run_ddptrain
from toys import TINY

pytestmark = pytest.mark.dist

STEPS = 12


def args(corpus: Path, out: str, mode: str, steps: int = STEPS) -> list[str]:
    """A tiny GPT on 2 ranks, 2 micro-batches each per step (accumulation), a constant LR (so that a first part
    run with fewer steps takes the same steps), PowerSGD from step 3 at rank 2."""
    return ["train", f"data.dir={corpus}", f"run.dir={out}", *TINY, "train.global_batch_size=16",
            f"train.max_steps={steps}", "schedule.name=constant", "ckpt.every_steps=3",
            f"dist.grad_compression={mode}", "dist.powersgd_rank=2", "dist.powersgd_start_step=3"]  # fmt: skip


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def local_files(run_dir: Path, step: int) -> list[str]:
    manifest = json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
    return sorted(name for name in manifest["files"] if name.startswith("grad_compression-"))


@pytest.fixture(scope="module")
def powersgd(corpus_dir: Path, reference_cache: Path) -> Path:
    return cached_run(reference_cache, args(corpus_dir, "{out}", "powersgd"), nproc=2)


@pytest.mark.timeout(300)
def test_fp16_and_powersgd_train(corpus_dir: Path, tmp_path: Path, powersgd: Path) -> None:
    fp16, fsdp = tmp_path / "fp16", tmp_path / "fsdp"
    done = run_ddptrain(args(corpus_dir, str(fp16), "fp16"), nproc=2, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    # Under FSDP fp16 is the reduce dtype of the gradients' reduce-scatter.
    done = run_ddptrain([*args(corpus_dir, str(fsdp), "fp16"), "dist.strategy=fsdp"], nproc=2, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for run in (fp16, powersgd, fsdp):
        loss = losses(run)
        assert sorted(loss) == list(range(1, STEPS + 1))
        assert sum(loss[s] for s in (10, 11, 12)) < sum(loss[s] for s in (1, 2, 3)), (run, loss)
        assert all(m["grad_accum"] == 2 for m in read_metrics(run))
    said = (powersgd / "logs" / "rank-0.log").read_text()
    assert "dist.grad_compression=powersgd: 0.007296 MB per step's all-reduce instead of 0.0864 MB" in said
    assert local_files(fp16, STEPS) == []  # fp16 keeps no state
    assert local_files(powersgd, STEPS) == ["grad_compression-rank0.pt", "grad_compression-rank1.pt"]
    # Compression changes the numbers: PowerSGD (from step 3) trains other weights than fp16.
    assert losses(powersgd)[2] != losses(fp16)[2] or losses(powersgd)[STEPS] != losses(fp16)[STEPS]


@pytest.mark.timeout(300)
def test_powersgd_resumes_bit_exact(corpus_dir: Path, tmp_path: Path, powersgd: Path) -> None:
    run = tmp_path / "resumed"
    first = run_ddptrain(args(corpus_dir, str(run), "powersgd", steps=6), nproc=2, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert local_files(run, 6) == ["grad_compression-rank0.pt", "grad_compression-rank1.pt"]
    second = run_ddptrain(args(corpus_dir, str(run), "powersgd"), nproc=2, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "fresh error feedback" not in second.stdout + second.stderr
    ref, got = losses(powersgd), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == ref[s] for s in got), [(s, got[s], ref[s]) for s in got if got[s] != ref[s]]
    a, b = final_model_state(powersgd), final_model_state(run)
    assert all(torch.equal(a[name], b[name]) for name in a)
    # verify-resume replays from the checkpoint (PowerSGD's state restored per rank) and matches the certificate.
    replay = run_ddptrain(["verify-resume", str(run), "--from", "9", "--steps", "2"], nproc=2, timeout=240)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    assert "identical: logged steps 10, 11" in replay.stdout + replay.stderr


@pytest.mark.timeout(120)
def test_bf16_is_refused_on_gloo_before_anything_is_written(corpus_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "bf16"
    done = run_ddptrain(args(corpus_dir, str(run), "bf16"), nproc=2, timeout=100)
    assert done.returncode == 2, done.stderr[-3000:]
    message = "dist.grad_compression=bf16 needs NCCL: gloo has no bfloat16 all-reduce"
    assert done.stderr.count("ddptrain train: error:") == done.stderr.count(message) >= 1, done.stderr[-3000:]
    # Refused before the lease (step 2): nothing but the rank logs, which a refused run leaves empty.
    written = {p.relative_to(run): p.stat().st_size for p in run.rglob("*") if p.is_file()}
    assert set(written) <= {Path("logs/rank-0.log"), Path("logs/rank-1.log")} and not any(written.values()), written
