"""`ddptrain slurm` without a cluster: the script is valid bash with the directives and launch line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ddptrain.cli import main


def _generate(tmp_path: Path, *args: str) -> Path:
    """Run `ddptrain slurm` in-process from tmp_path; returns the script path (exit code checked by callers)."""
    assert main(["slurm", f"run.dir={tmp_path / 'run'}", *args]) == 0
    return tmp_path / "run" / "slurm" / "job.sbatch"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def test_script_has_directives_and_one_launch_per_node(tmp_path: Path) -> None:
    script = _generate(tmp_path, "train.max_steps=7", "--nodes", "4", "--gpus-per-node", "8",
                       "--cpus-per-node", "32", "--time", "2:00:00", "--partition", "gpu",
                       "--signal-seconds", "300", "--max-requeues", "5", "--sbatch-arg=--qos=high")
    text = script.read_text()
    directives = re.findall(r"^#SBATCH (\S+)$", text, re.M)
    for d in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=32", "--time=2:00:00",
              "--partition=gpu", "--signal=B:USR1@300", "--requeue", "--open-mode=append", "--qos=high",
              f"--chdir={tmp_path}"):
        assert d in directives
    assert "MAX_REQUEUES=5" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and "--nodes=4" in srun and "--cpus-per-task=32" in srun
    for arg in ('--rdzv-endpoint "$RDZV_ENDPOINT"', '--run-id "$SLURM_JOB_ID"', '--node-addr "$addr"', "--nnodes 4",
                "--nproc-per-node 8", "--shutdown-timeout 100", f"train -c {tmp_path / 'run' / 'slurm' / 'config.yaml'}"):
        assert arg in srun
    frozen = (tmp_path / "run" / "slurm" / "config.yaml").read_text()
    assert "max_steps: 7" in frozen and "resume: auto" in frozen
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize("args, message", [
    (["ckpt.resume=never"], "use ckpt.resume=auto"),
    (["--signal-seconds", "20", "--save-seconds", "60"], "--signal-seconds=20 s is shorter than"),
    (["--time", "forever"], "not a SLURM time"),
    (["--nproc-per-node", "many"], "--nproc-per-node must be a positive integer"),
])
def test_refuses_what_breaks_requeue(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                     message: str) -> None:
    assert main(["slurm", f"run.dir={tmp_path / 'run'}", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_submit_without_sbatch_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on PATH
    assert main(["slurm", f"run.dir={tmp_path / 'run'}", "--submit"]) == 2
    assert "sbatch not found" in capsys.readouterr().err
