"""Every benchmark script starts and runs in smoke mode (tiny sizes, one round). No timings are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env_for_subprocess

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_bench_all_smoke(tmp_path: Path) -> None:
    """`python -m bench all --smoke` writes a JSON and a table with a row for every figure."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "all", "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result_file,) = out.glob("*-smoke.json")
    result = json.loads(result_file.read_text())
    figures = {r["figure"] for r in result["rows"]}
    assert figures == {
        "trainer overhead",
        "scaling",
        "peers",
        "gloo all-reduce",
        "grad compression",
        "overlap",
        "checkpoint",
        "checkpoint (2 ranks)",
        "checkpoint (4 ranks)",
        "hashes",
        "replica check",
        "certificate",
        "fsdp (2 ranks)",
        "lora (2 ranks)",
        "data",
        "tracking",
        "prepare",
    }
    # The Trainer and the hand-written loop must agree bit for bit on every loss.
    losses = result["figures"]["training (overhead, peers, scaling)"]["losses"]
    assert losses["ddptrain"] and losses["ddptrain"] == losses["raw"]
    peers = [r for r in result["rows"] if r["figure"] == "peers"]
    for row in peers:  # a peer either ran, or is named as skipped because it is not installed
        assert row["stats"] is not None or row["note"].startswith("skipped:")
    assert "| figure | metric |" in proc.stdout


@pytest.mark.timeout(120)
def test_gpu_script_smoke(tmp_path: Path) -> None:
    """bench/gpu.py --smoke runs on the CPU with a tiny model and writes its JSON."""
    proc = subprocess.run(
        [sys.executable, "bench/gpu.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result_file,) = tmp_path.glob("gpu-*.json")
    result = json.loads(result_file.read_text())
    assert {"matmul", "gpt2", "trainer_vs_raw", "ddp", "fsdp", "checkpoint", "hashes"} <= set(result)


@pytest.mark.timeout(120)
def test_a_failed_rank_of_a_forked_smoke_job_ends_the_job_and_names_its_error(tmp_path: Path) -> None:
    """Smoke mode forks a variant's ranks from bench's preloaded server (bench/forked.py): a rank that fails
    ends the others, as torchrun does, and run_job raises with the job's output."""
    script = (
        "import sys; from pathlib import Path; from bench.common import Variant, run_job\n"
        "run_job(Variant('fails', 'rank_fails', [], nproc=2, forked=True), Path(sys.argv[1]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "fails.log")],
        cwd=REPO,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "bench job fails failed (1):" in proc.stderr and "rank 1 gives up" in proc.stderr, proc.stderr
