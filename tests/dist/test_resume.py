"""Bit-exact resume after SIGKILL, single-process and with 2 ranks, and across world-size changes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import cached_run, final_model_state, read_metrics, run_ddptrain, start_ddptrain

pytestmark = pytest.mark.dist

STEPS = 10
GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "dropout": 0.1}  # dropout: RNG state matters


def killable(marker: Path, die_at_call: int, rank: int = 0) -> list[str]:
    kwargs = {**GPT, "die_at_call": die_at_call, "marker": str(marker), "rank": rank}
    return ["model.target=toy:build_killable_gpt", "model.kwargs=" + str(kwargs).replace("'", "")]


def common(corpus: Path, run_dir: Path) -> list[str]:
    return [
        f"data.dir={corpus}",
        f"run.dir={run_dir}",
        "model.block_size=32",
        "data.micro_batch_size=4",
        "train.global_batch_size=16",
        f"train.max_steps={STEPS}",
        "train.warmup_steps=2",
        "train.eval_every=0",
        "log.every_steps=1",
        "ckpt.every_steps=3",
    ]


def losses_by_step(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for m in read_metrics(run_dir):
        out.setdefault(m["step"], []).append(m["loss"])
    return out


def assert_bit_exact(reference: Path, resumed: Path) -> None:
    ref, got = losses_by_step(reference), losses_by_step(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():  # steps redone after the kill must repeat exactly too
        assert all(v == ref[step][0] for v in values), (step, values, ref[step])
    a, b = final_model_state(reference), final_model_state(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def reference_runs(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Uninterrupted runs at 1 and 2 ranks (the killable model with its kill disarmed)."""
    out = {}
    for nproc in (0, 2):
        run_dir = tmp_path_factory.mktemp(f"ref{nproc}")
        disarmed = run_dir / "never-kill"
        disarmed.write_text("")
        r = run_ddptrain(["train", *common(corpus_dir, run_dir), *killable(disarmed, 1)], nproc=nproc, timeout=180)
        assert r.returncode == 0, r.stderr
        out[nproc] = run_dir
    return out


@pytest.mark.timeout(240)
def test_sigkill_mid_accumulation_single_process(
    corpus_dir: Path, tmp_path: Path, reference_runs: dict[int, Path]
) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    accum = 4  # 16 / (4 x 1)
    call = 5 * accum + 2  # the 2nd micro-batch of step 6: after the step-3 checkpoint, mid accumulation
    args = ["train", *common(corpus_dir, run_dir), *killable(marker, call)]
    first = run_ddptrain(args)
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert marker.exists()
    second = run_ddptrain(args)
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stdout and "step-00000003" in second.stdout
    assert_bit_exact(reference_runs[0], run_dir)


@pytest.mark.timeout(240)
def test_sigkill_at_random_step_two_ranks(corpus_dir: Path, tmp_path: Path, reference_runs: dict[int, Path]) -> None:
    seed = int(os.environ.get("DDPTRAIN_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    accum = 2  # 16 / (4 x 2)
    call = rng.randint(1, STEPS * accum - 1)
    print(f"seed {seed}: rank 1 is killed at its training forward #{call}")
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    args = ["train", *common(corpus_dir, run_dir), *killable(marker, call, rank=1)]
    first = run_ddptrain(args, nproc=2, timeout=180)
    assert first.returncode != 0 and marker.exists(), first.stderr
    second = run_ddptrain(args, nproc=2, timeout=180)
    assert second.returncode == 0, second.stderr
    assert_bit_exact(reference_runs[2], run_dir)


@pytest.mark.timeout(240)
def test_sigkill_during_checkpoint_write(corpus_dir: Path, tmp_path: Path) -> None:
    """SIGKILL while a checkpoint folder is half written: it is never loaded; resume is still exact."""
    big = ["model.n_layer=2", "model.n_embd=256", "model.n_head=4", "model.dropout=0.1"]
    reference, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = run_ddptrain(["train", *common(corpus_dir, reference), *big, "ckpt.every_steps=2"], timeout=180)
    assert ref.returncode == 0, ref.stderr
    args = ["train", *common(corpus_dir, run_dir), *big, "ckpt.every_steps=2"]
    proc = start_ddptrain(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt_dir = run_dir / "checkpoints"
    deadline = time.monotonic() + 120
    seen_tmp = None
    # Kill at the first moment a temporary folder of the second save (step 4) exists.
    while time.monotonic() < deadline and proc.poll() is None:
        tmp = list(ckpt_dir.glob(".tmp-step-00000004.*")) if ckpt_dir.exists() else []
        if tmp:
            proc.send_signal(signal.SIGKILL)
            seen_tmp = tmp[0]
            break
        time.sleep(0.0005)
    proc.wait(timeout=30)
    assert seen_tmp is not None, "never caught the save in flight"
    assert not (ckpt_dir / "step-00000004").exists()
    resumed = run_ddptrain(args, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert "step-00000002" in resumed.stdout
    assert not seen_tmp.exists()  # the half-written folder was cleaned up, never loaded
    a, b = final_model_state(reference), final_model_state(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref_losses, got = losses_by_step(reference), losses_by_step(run_dir)
    assert all(v == ref_losses[s][0] for s, vs in got.items() for v in vs)


def consumed_ids(record_dir: Path) -> list[int]:
    return [
        int(i)
        for f in sorted(record_dir.glob("ids-*.txt"))
        for line in f.read_text().splitlines()
        for i in line.split()
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("w1", "w2"), [(2, 1), (1, 2)])
def test_world_size_change_neither_skips_nor_repeats(tmp_path: Path, reference_cache: Path, w1: int, w2: int) -> None:
    """100 samples, global batch 16: 6 steps per epoch (4 dropped); 9 steps cross into epoch 2."""

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
        ]

    # The uninterrupted 2-rank run, trained once for both directions ("{out}" is its folder).
    ref_rec = Path(f"{cached_run(reference_cache, args(Path('{out}'), Path('{out}-ids'), 9), nproc=2)}-ids")
    rec1, rec2, run_dir = tmp_path / "ids-a", tmp_path / "ids-b", tmp_path / "run"
    r1 = run_ddptrain(args(run_dir, rec1, 4), nproc=w1 if w1 > 1 else 0)
    assert r1.returncode == 0, r1.stderr
    r2 = run_ddptrain(args(run_dir, rec2, 9), nproc=w2 if w2 > 1 else 0)
    assert r2.returncode == 0, r2.stderr
    assert f"saved at world size {w1}, now {w2}" in r2.stdout
    first, second = consumed_ids(rec1), consumed_ids(rec2)
    assert len(first) == 4 * 16 and len(second) == 5 * 16
    # Epoch 1 is steps 1-6 (96 distinct ids), epoch 2 steps 7-9: per epoch no id twice, none missing.
    reference = consumed_ids(ref_rec)
    assert Counter(first + second) == Counter(reference)
    events = [m for m in read_metrics(run_dir, "event") if m["event"] in ("start", "resume")]
    assert [(e["event"], e["world_size"]) for e in events] == [("start", w1), ("resume", w2)]
