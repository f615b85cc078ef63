"""Activation checkpointing (full, every_n) under DDP (2 ranks) only recomputes: losses and final parameters equal a run without it.

(Under FSDP, tests/dist/test_fsdp_equivalence.py runs it against DDP without checkpointing.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import final_model_state, read_metrics, run_ddptrain

pytestmark = pytest.mark.dist

COMMON = ["model.n_layer=2", "train.max_steps=3", "ckpt.every_steps=0"]


@pytest.mark.timeout(120)
def test_ddp_with_activation_checkpointing_trains_as_without(tiny_args: list[str], tmp_path: Path) -> None:
    runs = {}
    for mode in ("none", "full", "every_n"):  # every_n: the default n=2 checkpoints the first of 2 blocks
        run_dir = tmp_path / mode
        args = ["train", *tiny_args, *COMMON, f"train.activation_checkpointing={mode}", f"run.dir={run_dir}"]
        r = run_ddptrain(args, nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = run_dir
    plain, x = read_metrics(runs["none"]), final_model_state(runs["none"])
    assert len(plain) == 3
    for mode in ("full", "every_n"):
        recomputed = read_metrics(runs[mode])
        assert [m["loss"] for m in recomputed] == pytest.approx([m["loss"] for m in plain], rel=1e-6), mode
        y = final_model_state(runs[mode])
        assert x.keys() == y.keys()  # the composable checkpoint() adds no name prefixes
        for name in x:
            torch.testing.assert_close(y[name], x[name], rtol=1e-6, atol=1e-6, msg=f"{mode}: {name}")
