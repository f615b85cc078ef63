"""`ddptrain slurm` without a cluster: the script is valid bash with the directives and launch line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from helpers import run_ddptrain


def _generate(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    proc = run_ddptrain(["slurm", f"run.dir={tmp_path / 'run'}", *args], cwd=tmp_path, env=env)
    return proc, tmp_path / "run" / "slurm" / "job.sbatch"


def test_script_has_directives_and_one_launch_per_node(tmp_path: Path) -> None:
    proc, script = _generate(tmp_path, "train.max_steps=7", "--nodes", "4", "--gpus-per-node", "8",
                             "--cpus-per-node", "32", "--time", "2:00:00", "--partition", "gpu",
                             "--signal-seconds", "300", "--max-requeues", "5", "--sbatch-arg=--qos=high")
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    directives = re.findall(r"^#SBATCH (\S+)$", text, re.M)
    for d in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=32", "--time=2:00:00",
              "--partition=gpu", "--signal=B:USR1@300", "--requeue", "--open-mode=append", "--qos=high"):
        assert d in directives
    assert "MAX_REQUEUES=5" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and "--nodes=4" in srun
    for arg in ('--rdzv-endpoint "$RDZV_ENDPOINT"', '--run-id "$SLURM_JOB_ID"', '--node-addr "$addr"', "--nnodes 4", "--shutdown-timeout 100",
                f"train -c {tmp_path / 'run' / 'slurm' / 'config.yaml'}"):
        assert arg in srun
    frozen = (tmp_path / "run" / "slurm" / "config.yaml").read_text()
    assert "max_steps: 7" in frozen and "resume: auto" in frozen
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_refuses_what_breaks_requeue(tmp_path: Path) -> None:
    proc, _ = _generate(tmp_path, "ckpt.resume=never")
    assert proc.returncode == 2 and "ckpt.resume=auto" in proc.stderr
    proc, _ = _generate(tmp_path, "--signal-seconds", "20", "--save-seconds", "60")
    assert proc.returncode == 2 and "--signal-seconds=20 s is shorter than" in proc.stderr
    proc, _ = _generate(tmp_path, "--time", "forever")
    assert proc.returncode == 2 and "not a SLURM time" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_submit_without_sbatch_is_a_clear_error(tmp_path: Path) -> None:
    proc, _ = _generate(tmp_path, "--submit", env={"PATH": str(tmp_path)})  # no sbatch on PATH
    assert proc.returncode == 2 and "sbatch not found" in proc.stderr
