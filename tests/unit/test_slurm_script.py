"""`ddptrain slurm` without a cluster: the script is valid bash with the directives and launch line."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from ddptrain.cli import main
from ddptrain.data.corpus import prepare_corpus


def _generate(tmp_path: Path, *args: str) -> Path:
    """Run `ddptrain slurm` in-process from tmp_path; returns the new script's path."""
    before = set((tmp_path / "run" / "slurm").glob("*/job.sbatch"))
    assert main(["slurm", f"run.dir={tmp_path / 'run'}", *args]) == 0
    (script,) = set((tmp_path / "run" / "slurm").glob("*/job.sbatch")) - before
    return script


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def test_script_has_directives_and_one_launch_per_node(tmp_path: Path) -> None:
    script = _generate(
        tmp_path,
        "train.max_steps=7",
        "train.global_batch_size=512",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--cpus-per-node",
        "32",
        "--time",
        "2:00:00",
        "--partition",
        "gpu",
        "--signal-seconds",
        "300",
        "--max-requeues",
        "5",
        "--sbatch-arg=--qos=high",
    )
    text = script.read_text()
    directives = re.findall(r"^#SBATCH (\S+)$", text, re.M)
    for d in (
        "--nodes=4",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--cpus-per-task=32",
        "--time=2:00:00",
        "--partition=gpu",
        "--signal=B:USR1@300",
        "--requeue",
        "--open-mode=append",
        "--qos=high",
        f"--chdir={tmp_path}",
    ):
        assert d in directives
    assert "MAX_REQUEUES=5" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and "--nodes=4" in srun and "--cpus-per-task=32" in srun
    for arg in (
        '--rdzv-endpoint "$RDZV_ENDPOINT"',
        '--run-id "$RDZV_ID"',
        '--node-addr "$addr"',
        "--nnodes 4",
        "--nproc-per-node 8",
        "--shutdown-timeout 100",
        f"train -c {script.parent / 'config.yaml'}",
    ):
        assert arg in srun
    assert "--mem=128G" in directives  # 16G per rank unless given
    assert "RDZV_PORT=$(( 10000 + SLURM_JOB_ID % 20000 ))" in text
    assert 'export RDZV_ID="$SLURM_JOB_ID"' in text  # c10d: the job id, kept by a requeued job
    frozen = (script.parent / "config.yaml").read_text()
    assert "max_steps: 7" in frozen and "resume: auto" in frozen
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["ckpt.resume=never"], "use ckpt.resume=auto"),
        (["--signal-seconds", "20", "--save-seconds", "60"], "--signal-seconds=20 s is shorter than"),
        (["--time", "forever"], "not a SLURM time"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be a positive integer"),
        (["--gpus-per-node", "8", "--nproc-per-node", "3"], "must be equal"),
        (["--nodes", "3"], "is not divisible"),
        (["--mem", "lots"], "is not a SLURM memory size"),
        (["--time", "0"], "not a SLURM time"),
        (["--cpus-per-node", "1", "--nproc-per-node", "2"], "fewer than the 2 ranks"),
        (["--sbatch-arg", "--qos=high\nsrun rm -rf /"], "must be one line"),
        (["--sbatch-arg", "qos=high"], "starting with '-'"),
        (["--etcd-endpoints", "10.0.0.1:2379;reboot"], "--etcd-endpoints: '10.0.0.1:2379;reboot' has no valid port"),
        (["--etcd-endpoints", "etcd-0,,etcd-1"], "must be HOST[:PORT][,HOST[:PORT]...]"),
        (["--nodes", "4", "--min-nodes", "5"], "--min-nodes 5 must be between 1 and --nodes 4"),
        (["--nodes", "4", "--min-nodes", "3"], "at 3 node(s)"),  # the global batch of 8 does not split over 3
    ],
)
def test_refuses_what_breaks_requeue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["slurm", f"run.dir={tmp_path / 'run'}", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list((tmp_path / "run").rglob("*.sbatch"))  # nothing written for an invalid job


def test_etcd_job_has_no_special_node(tmp_path: Path) -> None:
    """With --etcd-endpoints every node's launcher rendezvous through etcd; the job goes on without lost nodes."""
    etcd = ["--etcd-endpoints", "etcd-a:2379,10.0.0.2,[fd00::3]:2379"]
    batch = ["data.micro_batch_size=4", "train.global_batch_size=48"]  # splits over 2, 3 and 4 nodes
    script = _generate(tmp_path, *batch, "--nodes", "4", "--min-nodes", "2", *etcd)
    text = script.read_text()
    assert "export RDZV_ENDPOINT='etcd-a:2379,10.0.0.2:2379,[fd00::3]:2379'" in text  # quoted: [] is a bash glob
    assert 'export RDZV_ID="slurm-${SLURM_CLUSTER_NAME:-cluster}-$SLURM_JOB_ID"' in text
    assert "HEAD_NODE" not in text and "#SBATCH --no-kill" in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--rdzv-backend etcd-v2" in srun and "--nnodes 2:4" in srun
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_each_generation_freezes_its_own_config(tmp_path: Path) -> None:
    """A queued job keeps its config: generating again for the same run writes a new folder, even with --out."""
    first = _generate(tmp_path, "train.max_steps=7")
    second = _generate(tmp_path, "train.max_steps=9", "--rdzv-port", "4242")
    assert first.parent != second.parent
    assert "max_steps: 7" in (first.parent / "config.yaml").read_text()
    assert "max_steps: 9" in (second.parent / "config.yaml").read_text()
    assert "RDZV_PORT=4242" in second.read_text()
    out = str(tmp_path / "j.sbatch")
    assert main(["slurm", f"run.dir={tmp_path / 'run'}", "train.max_steps=11", "--out", out]) == 0
    assert "max_steps: 7" in (first.parent / "config.yaml").read_text()
    assert len(list((tmp_path / "run" / "slurm").glob("*/config.yaml"))) == 3


def test_submit_without_sbatch_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on PATH
    assert main(["slurm", f"run.dir={tmp_path / 'run'}", "--submit"]) == 2
    assert "sbatch not found" in capsys.readouterr().err


def _node_command(script: Path) -> str:
    """The command srun runs on each node (the `bash -c` argument of the srun line)."""
    srun = next(line for line in script.read_text().splitlines() if line.startswith("srun "))
    words = shlex.split(srun)
    return words[words.index("-c") + 1]


def test_the_script_names_what_every_node_must_see_and_each_node_checks_it(tmp_path: Path) -> None:
    data = tmp_path / "corpus"
    prepare_corpus([Path(shlex.__file__)], data, 0.1)
    script = _generate(tmp_path, f"data.dir={data}", "--python", str(tmp_path / "no-venv" / "bin" / "python"))
    text = script.read_text()
    for shared in (
        f"the working folder (--chdir): {tmp_path}",
        f"data.dir: {data}",
        f"run.dir: {tmp_path / 'run'}",
        f"the interpreter (--python): {tmp_path / 'no-venv' / 'bin' / 'python'}",
    ):
        assert f"#   {shared}\n" in text, text
    env = {"SLURMD_NODENAME": "node7", "PATH": "/usr/bin:/bin"}
    node = subprocess.run(["bash", "-c", _node_command(script)], capture_output=True, text=True, env=env, timeout=30)
    assert node.returncode == 2, node
    assert node.stderr == (
        f"ddptrain-slurm: node node7 cannot see the interpreter (--python) "
        f"{tmp_path / 'no-venv' / 'bin' / 'python'}: every node must see it at the same path "
        "(a shared filesystem)\n"
    )
    (tmp_path / "corpus-gone").mkdir()
    moved = _generate(tmp_path, f"data.dir={data}", "--python", "sh")  # a name on PATH is found there
    data.rename(tmp_path / "corpus-gone" / "corpus")  # as if this node did not mount it
    node = subprocess.run(["bash", "-c", _node_command(moved)], capture_output=True, text=True, env=env, timeout=30)
    assert node.returncode == 2 and f"cannot see data.dir {data}: every node" in node.stderr, node


def test_a_data_dir_without_a_prepared_corpus_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["slurm", f"run.dir={tmp_path / 'run'}", "data.dir=nowhere"]) == 2
    err = capsys.readouterr().err
    assert f"data.dir nowhere ({tmp_path / 'nowhere'}) holds no prepared corpus (meta.json)" in err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()
    default = _generate(tmp_path)  # the default corpus is prepared on first use: not checked on the nodes
    assert "data/stdlib ]" not in _node_command(default)
