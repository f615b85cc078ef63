"""Silent corruption on one rank under torchrun (gloo): a flipped bit is caught at the next check, before a save.

tests/faulty.py flips bit 3 of one weight (or, through its optimizer, of one AdamW moment) on one
rank at step 23, once. The check runs every 5 steps (logged steps) and before every checkpoint
(every 10): the run stops at step 25 with exit 1 naming the rank and host, checkpoints 10 and 20
only are committed, and the same command again resumes from step 20 and finishes.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from helpers import read_metrics, run_ddptrain

pytestmark = pytest.mark.dist

BASE = [
    "model.target=faulty:build_model",
    "data.target=toy:build_datasets",
    "data.micro_batch_size=8",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "log.every_steps=5",
    "log.replica_check_every=5",
    "ckpt.every_steps=10",
    "train.max_steps=30",
    "log.straggler_every=0",
]


def args(run_dir: Path, nproc: int, optimizer: bool) -> list[str]:
    flip = "optim.kwargs" if optimizer else "model.kwargs"
    extra = ["optim.target=faulty:build_flipping_adamw"] if optimizer else []
    return [
        "train",
        *BASE,
        *extra,
        f"train.global_batch_size={8 * nproc}",
        f"run.dir={run_dir}",
        f"{flip}.flip_at=23",
        f"{flip}.flip_rank=1",
        f"{flip}.flip_marker={run_dir.parent / 'flipped'}",
    ]


def committed(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


def diverges_then_resumes(tmp_path: Path, nproc: int, optimizer: bool) -> tuple[str, dict]:
    run_dir = tmp_path / "run"
    done = run_ddptrain(args(run_dir, nproc, optimizer), nproc=nproc, timeout=150)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "flipped").is_file()
    # rank 0's error line (stderr also holds torchrun's summary of the ranks' exceptions)
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error: replicas diverged")]
    assert committed(run_dir) == ["step-00000010", "step-00000020"]  # nothing after the flip at 23
    [event] = [r for r in read_metrics(run_dir, "event") if r["event"] == "replica_divergence"]
    assert event["step"] == 25 and event["agreed_step"] == 20 and event["verdict"] in line
    forensics = json.loads((run_dir / "stacks" / "replicas.json").read_text())
    assert forensics["verdict"] == event["verdict"]
    triage = run_ddptrain(["triage", str(run_dir)], timeout=60)
    assert triage.returncode == 0 and event["verdict"] in triage.stdout, triage.stdout + triage.stderr
    again = run_ddptrain(args(run_dir, nproc, optimizer), nproc=nproc, timeout=150)  # the flip happened once
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "step-00000030" in committed(run_dir)
    assert [r["step"] for r in read_metrics(run_dir)][-2:] == [25, 30]
    print(line)
    return line, event


@pytest.mark.timeout(400)
def test_three_ranks_name_the_corrupted_rank_and_tensor(tmp_path: Path) -> None:
    line, event = diverges_then_resumes(tmp_path, 3, optimizer=False)
    host = socket.gethostname()
    assert (
        f"replicas diverged by step 25 (they agreed at step 20): rank 1 on {host} differs from the majority "
        f"(rank 0 on {host}, 2 on {host}), in param:net.0.weight;" in line
    )
    assert event["splits"][0]["ranks"] == [1] and event["splits"][0]["tensors"]["1"][0] == "param:net.0.weight"


@pytest.mark.timeout(400)
def test_two_ranks_name_both_and_a_flipped_optimizer_moment(tmp_path: Path) -> None:
    line, event = diverges_then_resumes(tmp_path, 2, optimizer=True)
    assert "ranks 0 on " in line and "with no majority which one is wrong cannot be told" in line
    assert event["splits"][0]["ranks"] == [0, 1]
    # The moment flipped after step 23's update; steps 24 and 25 may carry it into the weight.
    named = event["splits"][0]["tensors"]["1"]
    assert "optim:net.0.weight.exp_avg" in named and set(named) <= {"param:net.0.weight", "optim:net.0.weight.exp_avg"}


@pytest.mark.timeout(300)
def test_hsdp_compares_the_ranks_holding_the_same_shard(tmp_path: Path) -> None:
    # 2 x 2: ranks 0 and 2 hold one shard, 1 and 3 the other; rank 1's AdamW moment shard flips.
    run_dir = tmp_path / "run"
    hsdp = ["dist.strategy=hsdp", "dist.shard_size=2", "model.shard_units=[Linear]"]
    done = run_ddptrain([*args(run_dir, 4, optimizer=True), *hsdp], nproc=4, timeout=240)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    [event] = [r for r in read_metrics(run_dir, "event") if r["event"] == "replica_divergence"]
    [split] = event["splits"]
    assert split["group"] == [1, 3] and split["ranks"] == [1, 3] and event["step"] == 25
    assert "optim:net.0.weight.exp_avg" in split["tensors"]["1"]
    assert committed(run_dir) == ["step-00000010", "step-00000020"]
    print(event["verdict"])
