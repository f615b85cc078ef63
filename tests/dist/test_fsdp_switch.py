"""A checkpoint of one strategy resumes the other: DDP -> FSDP -> DDP, continuing as an FSDP-only run does."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import read_metrics, run_ddptrain

pytestmark = pytest.mark.dist

# A constant schedule: the runs stop at 2, 4 and 6 steps, and a cosine would follow train.max_steps.
COMMON = ["model.n_layer=2", "train.global_batch_size=16", "ckpt.every_steps=2", "schedule.name=constant"]


def train(args: list[str], steps: int, *extra: str) -> None:
    r = run_ddptrain(["train", *args, *COMMON, f"train.max_steps={steps}", *extra], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.timeout(180)
def test_ddp_checkpoint_resumes_fsdp_and_back(tiny_args: list[str], tmp_path: Path) -> None:
    switched, fsdp = [*tiny_args, f"run.dir={tmp_path / 'switched'}"], [*tiny_args, f"run.dir={tmp_path / 'fsdp'}"]
    train(switched, 2)
    train(switched, 4, "dist.strategy=fsdp")  # the optimizer state is re-keyed by parameter name
    train(switched, 6)  # and back to indices
    train(fsdp, 6, "dist.strategy=fsdp")
    a, b = read_metrics(tmp_path / "switched"), read_metrics(tmp_path / "fsdp")
    assert [m["step"] for m in a] == list(range(1, 7))
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-5)
