"""2 ranks under torchrun with global batch B == 1 process with the same B (accumulation 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import final_model_state, read_metrics, run_ddptrain

pytestmark = pytest.mark.dist


@pytest.mark.timeout(180)
def test_two_ranks_match_one_process_step_by_step(tiny_args: list[str], tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    common = [*tiny_args, "train.max_steps=8", "ckpt.every_steps=0"]
    r1 = run_ddptrain(["train", *common, f"run.dir={one}"])
    assert r1.returncode == 0, r1.stderr
    r2 = run_ddptrain(["train", *common, f"run.dir={two}"], nproc=2)
    assert r2.returncode == 0, r2.stderr
    m1, m2 = read_metrics(one), read_metrics(two)
    assert [m["grad_accum"] for m in m1] == [2] * 8 and [m["grad_accum"] for m in m2] == [1] * 8
    assert [m["world_size"] for m in m2] == [2] * 8
    assert [m["loss"] for m in m2] == pytest.approx([m["loss"] for m in m1], rel=1e-5)
    p1, p2 = final_model_state(one), final_model_state(two)
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=1e-5, atol=1e-6, msg=name)
