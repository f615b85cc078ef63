"""The sharded checkpoint writer across processes: 2 ranks save their shares; 2 or 3 ranks resume with the
shared load (each rank, or each host's ranks, read and verify a share of the files, the rest arrives from
the other ranks)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import TESTS_DIR, folder_bytes, run_ddptrain

pytestmark = pytest.mark.dist


def worker(nproc: int, mode: str, run_dir: Path, ok: bool = True, *extra: str) -> subprocess.CompletedProcess[str]:
    """shard_worker.py MODE RUN_DIR EXTRA on nproc local ranks (through `ddptrain launch`)."""
    done = run_ddptrain([str(TESTS_DIR / "shard_worker.py"), mode, str(run_dir), *extra], nproc=nproc, timeout=90)
    assert (done.returncode == 0) == ok, done.stderr[-3000:]
    return done


def listed_bytes(folder: Path) -> int:
    return sum(entry["size"] for entry in json.loads((folder / "manifest.json").read_text())["files"].values())


def loaded(run_dir: Path, mode: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((run_dir / f"loaded-{mode}-{world}-rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(300)
def test_ranks_share_the_load_fall_back_together_survive_a_lost_rank_and_resume_at_another_world_size(
    tmp_path: Path,
) -> None:
    # Saves steps 1 and 2, flips a byte of a part of step 2 that only rank 1 reads, resumes at world size 2.
    ckpts = tmp_path / "checkpoints"
    out = worker(2, "save", tmp_path).stdout
    step1 = listed_bytes(ckpts / "step-00000001")
    step2 = listed_bytes(next(ckpts.glob("archive/after-step-1-*/step-00000002")))  # rejected: moved aside
    flipped = (tmp_path / "flipped.txt").read_text()
    # Rank 1 found it; rank 0 reports it and every rank falls back to step 1 together.
    assert f"checkpoint rejected: step-00000002: file {flipped} does not match its BLAKE3" in out
    manifest = json.loads((ckpts / "step-00000001" / "manifest.json").read_text())
    assert manifest["writer"] == "sharded" and manifest["world_size"] == 2
    per_rank = [sum(manifest["files"][f"tensors-{p}-of-4.bin"]["size"] for p in (2 * r, 2 * r + 1)) for r in range(2)]
    assert min(per_rank) > 0.4 * sum(per_rank)  # each rank wrote about half of the tensors' bytes (two files each)
    two = loaded(tmp_path, "save", 2)
    # Each rank read only its share of both checkpoints tried: every byte once in total, none twice.
    assert sum(r["bytes_read"] for r in two) == step1 + step2
    assert all(r["bytes_read"] < 0.7 * (step1 + step2) for r in two)
    # ckpt.load=every-rank (what auto does on one host): each rank reads what it needs itself, nothing is sent.
    every = json.loads((tmp_path / "loaded-save-every-rank-2-rank1.json").read_text())
    assert every["equal"] and 0.9 * step1 < every["bytes_read"] <= step1

    # A rank lost in the middle of the exchange: the job fails, no rank got any state, nothing on disk changed.
    before = folder_bytes(ckpts)
    died = worker(2, "die", tmp_path, ok=False)
    assert not list(tmp_path.glob("loaded-die-*")), died.stderr[-3000:]
    assert folder_bytes(ckpts) == before
    # The restart (here at world size 3, as if ranks 0 and 1 ran on host a and rank 2 on host b: ckpt.load=auto
    # splits the files over the hosts, not the ranks) resumes bit-exact. Host a's ranks both read a's share
    # (one page cache), b reads the rest; each file is read on one host only: storage reads it once.
    worker(3, "nodes", tmp_path, True, "a,a,b")
    three = loaded(tmp_path, "nodes", 3)
    sizes = manifest["files"]
    for r in three:
        assert r["bytes_read"] == sum(sizes[n]["size"] for n in r["plan_reads"])
    host_a, host_b = set(three[0]["plan_reads"]) | set(three[1]["plan_reads"]), set(three[2]["plan_reads"])
    assert not host_a & host_b and host_a | host_b == set(sizes)
    assert sum(sizes[n]["size"] for n in host_a | host_b) == step1 and 0 < len(host_b) < len(sizes)
    assert three[0]["bytes_read"] > 0.3 * step1 and three[2]["bytes_read"] > 0.3 * step1
    for world, results in ((2, two), (3, three)):
        for rank, result in enumerate(results):
            assert result["equal"] and result["writer"] == "sharded" and result["saved_world"] == 2
            assert result["rng"] == ({"rank": rank} if world == 2 else None)  # RNG only at the saved world size
