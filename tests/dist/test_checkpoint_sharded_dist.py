"""The sharded checkpoint writer across processes: 2 ranks save their shares, 1 or 2 ranks resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TESTS_DIR, env_for_subprocess

pytestmark = pytest.mark.dist


def worker(nproc: int, mode: str, run_dir: Path) -> str:
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, *launch, str(TESTS_DIR / "shard_worker.py"), mode, str(run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env_for_subprocess())
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(120)
def test_two_ranks_save_their_shares_and_any_world_size_resumes_identically_past_a_corrupt_part(
    tmp_path: Path,
) -> None:
    # Saves steps 1 and 2, flips a byte of rank 1's part of step 2, resumes at world size 2.
    out = worker(2, "save", tmp_path)
    assert "checkpoint rejected: step-00000002: file tensors-3-of-4.bin does not match its BLAKE3" in out
    folder = tmp_path / "checkpoints" / "step-00000001"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["writer"] == "sharded" and manifest["world_size"] == 2
    per_rank = [sum(manifest["files"][f"tensors-{p}-of-4.bin"]["size"] for p in (2 * r, 2 * r + 1)) for r in range(2)]
    assert min(per_rank) > 0.4 * sum(per_rank)  # each rank wrote about half of the tensors' bytes (two files each)
    worker(1, "load", tmp_path)
    for world in (1, 2):
        for rank in range(world):
            loaded = json.loads((tmp_path / f"loaded-{world}-rank{rank}.json").read_text())
            assert loaded["equal"] and loaded["writer"] == "sharded" and loaded["saved_world"] == 2
            assert loaded["rng"] == ({"rank": rank} if world == 2 else None)  # RNG only at the saved world size
