"""`ddptrain slurm --fault-tolerance torchft`'s script, its lines run with stand-ins for scontrol and srun.

(tests/unit/test_ft_jobs.py reads the generated jobs back; these run processes, so they live here.)
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddptrain.cli import main

pytestmark = pytest.mark.dist

FT = ["--fault-tolerance", "torchft"]
BATCH = ["data.micro_batch_size=4", "train.global_batch_size=24"]  # splits over 1, 2 and 3 groups


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def fake_slurm_tools(folder: Path, srun_log: Path) -> dict[str, str]:
    """An environment whose `scontrol` answers for nodes n0, n1 and whose `srun` logs its arguments and exits
    (as a Lighthouse that stopped would), for running the script's own lines here."""
    folder.mkdir()
    (folder / "scontrol").write_text(
        '#!/bin/bash\nif [ "$2" = hostnames ]; then echo n0; echo n1; else echo "NodeName=$3 NodeAddr=10.0.0.${3#n} x"; fi\n'
    )
    (folder / "srun").write_text(f'#!/bin/bash\necho "$@" >> {shlex.quote(str(srun_log))}\nexit 1\n')
    for tool in ("scontrol", "srun"):
        (folder / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[0-1]"}


def test_slurm_runs_the_lighthouse_as_a_step_restarted_at_one_address(tmp_path: Path) -> None:
    assert main(["slurm", *FT, "--nodes", "3", "--rdzv-port", "29510", *BATCH, f"run.dir={tmp_path / 'run'}"]) == 0
    (script,) = (tmp_path / "run" / "slurm").glob("*/job.sbatch")
    text = script.read_text()
    assert "#SBATCH --no-kill" in re.findall(r"^#SBATCH \S+", text, re.M)  # a lost node leaves the others going
    srun = next(line for line in text.splitlines() if line.startswith("srun --nodes=3"))
    assert '--fault-tolerance torchft --lighthouse "$LIGHTHOUSE" --replica-group "$SLURM_NODEID" --nnodes 1' in srun
    assert "--rdzv-endpoint" not in srun and '--node-addr "$addr"' in srun
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0

    # The Lighthouse lines, run with stand-ins for scontrol and srun: it is started on the first node's
    # address, restarted there when it stops, and stopped with the script.
    section = text[text.index("HEAD_NODE=") : text.index('trap \'kill "$lighthouse_pid"')]
    log = tmp_path / "srun.log"
    env = fake_slurm_tools(tmp_path / "bin", log)
    pid_file = tmp_path / "keeper.pid"
    body = f'{section}\necho "$lighthouse_pid" > {shlex.quote(str(pid_file))}\nwait "$lighthouse_pid"\n'
    shell = subprocess.Popen(["bash", "-c", body], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while (not log.exists() or len(log.read_text().splitlines()) < 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)  # what the script's EXIT trap does
        said, _ = shell.communicate(timeout=30)
    finally:
        if shell.poll() is None:
            shell.kill()
    assert shell.returncode == 0
    assert "ddptrain-slurm: the Lighthouse stopped (exit 1) at " in said and "restarting it on 10.0.0.0:29510" in said
    starts = log.read_text().splitlines()
    assert len(starts) >= 2
    for line in starts:
        assert "--overlap --nodelist=n0" in line and line.endswith("-m ddptrain lighthouse --bind 10.0.0.0:29510")


def test_slurm_node_line_is_a_launch_joining_the_lighthouse(tmp_path: Path) -> None:
    assert main(["slurm", *FT, "--nodes", "2", *BATCH, f"run.dir={tmp_path / 'run'}"]) == 0
    (script,) = (tmp_path / "run" / "slurm").glob("*/job.sbatch")
    srun = next(line for line in script.read_text().splitlines() if line.startswith("srun --nodes=2"))
    node_cmd = shlex.split(srun)[-2]  # bash -c NODE_CMD &
    node_cmd = node_cmd.replace(" -- train -c ", " --dry-run -- train -c ")
    env = fake_slurm_tools(tmp_path / "bin", tmp_path / "srun.log")
    env |= {"LIGHTHOUSE": "10.0.0.0:12345", "SLURM_NODEID": "1", "SLURMD_NODENAME": "n1"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    r = subprocess.run(["bash", "-c", node_cmd], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (group,) = [line for line in r.stdout.splitlines() if " torchrun " in line]
    for expected in (
        "TORCHFT_LIGHTHOUSE=http://10.0.0.0:12345",
        "DDPTRAIN_REPLICA_GROUP=1",
        "DDPTRAIN_BIND_ADDR=10.0.0.1",
    ):
        assert expected in group.split(), group
