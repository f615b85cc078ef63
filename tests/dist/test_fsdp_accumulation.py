"""Under fsdp on 2 ranks, accumulating 2 micro-batches of 4 trains as 1 micro-batch of 8 (same global batch).

The same runs check what the step timer reports under FSDP2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import final_model_state, read_metrics, run_ddptrain

pytestmark = pytest.mark.dist

STEPS = 3
COMMON = ["model.n_layer=2", "train.global_batch_size=16", f"train.max_steps={STEPS}", "ckpt.every_steps=0",
          "dist.strategy=fsdp"]  # fmt: skip


@pytest.mark.timeout(120)
def test_fsdp_accumulation_matches_one_big_micro_batch(tiny_args: list[str], tmp_path: Path) -> None:
    runs = {}
    for micro in (4, 8):
        run_dir = tmp_path / f"micro{micro}"
        r = run_ddptrain(
            ["train", *tiny_args, *COMMON, f"data.micro_batch_size={micro}", f"run.dir={run_dir}"], nproc=2
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[micro] = run_dir
    accum, whole = read_metrics(runs[4]), read_metrics(runs[8])
    # The non-last micro-batch skips its reduce-scatter: only the summed gradient is reduced, once.
    assert [m["grad_accum"] for m in accum] == [2] * STEPS and [m["grad_accum"] for m in whole] == [1] * STEPS
    # The step timer under FSDP2: no comm hook, so no comm_wait_s; the reduce-scatter's exposed time is measured.
    assert all("exposed_comm_s" in m and "comm_wait_s" not in m for m in accum)
    assert [m["loss"] for m in accum] == pytest.approx([m["loss"] for m in whole], rel=1e-5)
    x, y = final_model_state(runs[8]), final_model_state(runs[4])
    assert x.keys() == y.keys()
    for name in x:
        torch.testing.assert_close(y[name], x[name], rtol=1e-5, atol=1e-5, msg=name)
