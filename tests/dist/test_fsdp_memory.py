"""Under FSDP on 2 ranks each rank holds about half of the parameters and of the AdamW state (DDP: all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TESTS_DIR, run_ddptrain

pytestmark = pytest.mark.dist


@pytest.mark.timeout(120)
def test_fsdp_ranks_hold_half_of_parameters_and_optimizer_state(corpus_dir: Path, tmp_path: Path) -> None:
    done = run_ddptrain([str(TESTS_DIR / "fsdp_shard_worker.py"), str(corpus_dir), str(tmp_path)], nproc=2, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        ddp, fsdp = rank["ddp"], rank["fsdp"]
        assert fsdp["param_full"] == ddp["param_full"] > 100_000
        assert ddp["param_local"] == ddp["param_full"] and ddp["optim_local"] == ddp["optim_full"]
        assert ddp["optim_full"] == 2 * ddp["param_full"]  # AdamW: exp_avg and exp_avg_sq
        assert fsdp["param_local"] == pytest.approx(fsdp["param_full"] / 2, rel=0.02)
        assert fsdp["optim_local"] == pytest.approx(fsdp["optim_full"] / 2, rel=0.02)
        # DDP's writer gets the whole model; FSDP's (dcp) only this rank's shards, never gathered.
        assert fsdp["state_dict_local"] == pytest.approx(ddp["state_dict_local"] / 2, rel=0.02)
    assert sum(r["fsdp"]["param_local"] for r in ranks) == ranks[0]["fsdp"]["param_full"]
