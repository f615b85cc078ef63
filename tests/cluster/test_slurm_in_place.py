"""`ddptrain slurm --fault-tolerance torchft` on a real SLURM cluster (slurmctld + slurmd on loopback): the
Lighthouse runs as a job step of its own beside the training step, on the first node's address, and is
stopped when the job ends; the node's launch joins it as replica group $SLURM_NODEID."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TINY, env_for_subprocess, read_metrics
from slurm_harness import SlurmCluster, report, skip_reason
from test_slurm_jobs import DONE, JOB, _job_log

pytestmark = pytest.mark.cluster
pytest.importorskip("torchft.coordination", reason="torchft is the ft extra (make installs it)")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[SlurmCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    report(pytestconfig, f"SLURM cluster up and idle in {cluster.started_s:.2f} s")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.timeout(300)
def test_in_place_job_runs_its_lighthouse_beside_the_training_step(
    slurm: SlurmCluster, corpus_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = [*TINY, "train.max_steps=20", f"data.dir={corpus_dir}", f"run.dir={run_dir}", *JOB]
    proc = subprocess.run(
        [sys.executable, "-m", "ddptrain", "slurm", *argv, "--fault-tolerance", "torchft", "--submit"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=slurm.env(env_for_subprocess()),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split("submitted job ")[1].strip()
    info = slurm.wait_for(job, DONE, 240)
    log = _job_log(run_dir)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    assert "ddptrain-slurm: training finished" in log
    assert read_metrics(run_dir)[-1]["step"] == 20
    # Started before the training, never restarted while it ran, cancelled with the job (its srun is ended by
    # the script's EXIT trap, so the log shows its step CANCELLED after "training finished").
    match = re.search(r"lighthouse serving on http://127\.0\.0\.1:(\d+) ", log)
    assert match and log.index(match[0]) < log.index("training default:"), log
    assert "the Lighthouse stopped" not in log
    bind = f"lighthouse --bind 127.0.0.1:{match[1]}"
    deadline = time.monotonic() + 30
    while any(bind in cmdline for cmdline in command_lines()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(bind in cmdline for cmdline in command_lines())


def command_lines() -> list[str]:
    """Every process's command line, from /proc."""
    lines = []
    for entry in Path("/proc").iterdir():
        try:
            lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue  # not a process, or gone
    return lines
