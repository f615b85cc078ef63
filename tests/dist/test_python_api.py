"""The Python API under torchrun, and the set-up's collectives: one order on every rank and path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TESTS_DIR, env_for_subprocess, run_ddptrain

pytestmark = pytest.mark.dist
REPO = TESTS_DIR.parent


def torchrun(script: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_for_subprocess())


def test_python_api_example_trains_under_launch(tmp_path: Path) -> None:
    """`ddptrain launch -- script.py ARGS` runs a Python script on every worker, as torchrun does."""
    run_dir = tmp_path / "waves"
    script = REPO / "examples" / "python_api" / "train_waves.py"
    done = run_ddptrain([str(script), str(run_dir)], nproc=2, launcher="launch", timeout=180)  # launch -- script.py
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("finished:"))
    assert line.startswith("finished: step 60, loss ")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert records[0]["world_size"] == 2 and losses[-1] < losses[0] * 0.8
    assert (run_dir / "checkpoints" / "step-00000060" / "manifest.json").is_file()


def test_setup_collectives_are_one_order_on_every_rank_and_path(corpus_dir: Path, tmp_path: Path) -> None:
    done = torchrun(TESTS_DIR / "setup_order_worker.py", str(corpus_dir), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1], "ranks issued different collectives during set-up"
    init, cli, api = ranks[0]["init"], ranks[0]["cli"], ranks[0]["api"]
    assert init[0] == "init_process_group" and "all_gather_object" in init  # host names, once
    assert cli == api, "the config path and the live-objects path set up in different orders"
    assert cli[0] == "broadcast_object_list", cli  # build_run's first: every rank learns the run folder's lease
    # checkpointer.setup (its group), triage.setup (a broadcast, the pids), then the resume: rank 0 offers the
    # next candidate (none in a fresh folder: no verdicts to gather) and broadcasts its decision, in that order
    assert cli[-5:] == [
        "new_group",
        "broadcast_object_list",
        "all_gather_object",
        "broadcast_object_list",
        "broadcast_object_list",
    ], cli
