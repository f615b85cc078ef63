"""`ddptrain slurm` and `ddptrain k8s` with --fault-tolerance torchft: the Lighthouse beside the job, one replica
group per node, read back from the script and the manifest and run as far as this machine allows."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from kubeflow_operator import injected_env, schema_errors, webhook_errors
from test_job_script_inputs import STUB_PYTHON, assert_refused, files_under, hostile_text, slurm, workspace
from test_k8s_manifest_inputs import hostile_text as k8s_hostile_text
from test_k8s_manifest_inputs import kubelet_expand, unscriptable

from ddptrain.cli import main

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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "3", "--min-nodes", "2"], "--min-nodes is for the restart mode"),
        (["--nodes", "2", "--etcd-endpoints", "10.0.0.9:2379"], "--etcd-endpoints is for the restart mode"),
        (["--nodes", "3", "train.global_batch_size=32", "data.micro_batch_size=4"], "at 3 node(s)"),
    ],
)
def test_slurm_refuses_what_the_in_place_mode_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["slurm", *FT, *args, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not list((tmp_path / "run").rglob("*.sbatch"))


def k8s_documents(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    assert main(["k8s", "--image", "registry.example/ddptrain:1", *FT, *args]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def test_k8s_serves_the_lighthouse_behind_a_service_and_each_pod_is_a_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mount = tmp_path / "etc"  # where each pod sees the ConfigMap: here, a folder holding what it holds
    docs = k8s_documents(
        capsys, "--nodes", "3", "--name", "ft", "--namespace", "ml", "--config-mount", str(mount), *BATCH
    )
    assert [d["kind"] for d in docs] == ["ConfigMap", "Deployment", "Service", "PyTorchJob"]
    config_map, deployment, service, job = docs
    mount.mkdir()
    (mount / "config.yaml").write_text(config_map["data"]["config.yaml"])
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "ft-lighthouse"
    assert {d["metadata"]["namespace"] for d in docs} == {"ml"}
    spec = deployment["spec"]
    assert (spec["replicas"], spec["strategy"]["type"]) == (1, "Recreate")  # never two Lighthouses at once
    assert spec["selector"]["matchLabels"] == spec["template"]["metadata"]["labels"] == service["spec"]["selector"]
    (lighthouse,) = spec["template"]["spec"]["containers"]
    assert lighthouse["command"] == ["ddptrain", "lighthouse", "--bind", "$(POD_IP):29510"]
    assert service["spec"]["ports"][0]["port"] == 29510

    assert schema_errors(job) == [] and webhook_errors(job) == ([], [])
    assert "elasticPolicy" not in job["spec"]  # membership is torchft's: no torchrun rendezvous across pods
    groups = []
    for role, replicas in job["spec"]["pytorchReplicaSpecs"].items():
        for index in range(replicas["replicas"]):
            injected = dict(injected_env(job, role, index)) | {"POD_IP": f"10.1.0.{index + (role == 'Worker')}"}
            (c,) = replicas["template"]["spec"]["containers"]
            argv = []
            for word in c["command"][1:]:
                text, refs = kubelet_expand(word)
                for ref in refs:
                    text = text.replace(f"$({ref})", injected[ref])
                argv.append(text)
            assert argv[argv.index("--lighthouse") + 1] == "ft-lighthouse:29510"
            with contextlib.redirect_stdout(io.StringIO()) as out:
                argv.insert(argv.index("--"), "--dry-run")
                assert main(argv) == 0
            (line,) = [line for line in out.getvalue().splitlines() if " torchrun " in line]
            groups.append(
                dict(w.split("=", 1) for w in shlex.split(line.split(" torchrun ")[0]))["DDPTRAIN_REPLICA_GROUP"]
            )
    assert sorted(groups) == ["0", "1", "2"]  # distinct per pod, from the operator's replica index


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nodes", "3", "--min-nodes", "2"],
            "--min-nodes is for the restart mode: with --fault-tolerance torchft any pod",
        ),
        (["--nodes", "2", "--etcd-service", "etcd"], "--etcd-service is for the restart mode"),
    ],
)
def test_k8s_refuses_what_the_in_place_mode_cannot_use(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["k8s", "--image", "i", *FT, *args, *BATCH]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@settings(max_examples=30, deadline=None)
@given(image=k8s_hostile_text, namespace=k8s_hostile_text, priority=k8s_hostile_text)
def test_k8s_lighthouse_values_are_refused_or_carried_through(image: str, namespace: str, priority: str) -> None:
    values = {"--image": f"reg.example/{image}", "--namespace": namespace, "--priority-class": priority}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["k8s", *FT, "--name", "job", *(f"{flag}={v}" for flag, v in values.items())])
    bad = [f for f, v in values.items() if unscriptable(v) or (f == "--image" and any(c.isspace() for c in v))]
    if bad:
        assert rc == 2 and err.getvalue().count("\n") == 1 and any(f in err.getvalue() for f in bad), err.getvalue()
        return
    assert rc == 0, err.getvalue()
    _, deployment, service, _ = yaml.safe_load_all(out.getvalue())
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == values["--image"] and pod["priorityClassName"] == priority
    assert deployment["metadata"]["namespace"] == service["metadata"]["namespace"] == namespace


# srun on the stub cluster: the training step (`bash -c CMD`) runs its command; the Lighthouse step
# (`srun OPTIONS PYTHON -m ddptrain lighthouse ...`) runs its interpreter with ARGV_RECORD pointed elsewhere.
STUB_SRUN_FT = """#!/bin/bash
while [ "$#" -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
if [ "$1" = bash ]; then exec "$@"; fi
ARGV_RECORD="$LIGHTHOUSE_RECORD" exec "$@"
"""


@settings(max_examples=25, deadline=None)
@given(folder=hostile_text.filter(lambda s: "/" not in s))
def test_any_interpreter_path_runs_the_lighthouse_as_one_word(folder: str) -> None:
    with workspace() as root:
        (root / "bin" / "srun").write_text(STUB_SRUN_FT)
        python = root / folder / "python"
        before = files_under(root) | {root / "cfg.yaml"}
        if not unscriptable(folder):
            python.parent.mkdir(exist_ok=True)
            python.write_text(STUB_PYTHON)
            python.chmod(0o755)
            before = files_under(root) | {root / "cfg.yaml"}
        rc, err = job_script(root, "--python", str(python), *FT, "--out", "job.sbatch")
        if unscriptable(folder):
            assert_refused(rc, err, "--python", root, before)
            return
        assert rc == 0, err
        record, lighthouse = root / "argv", root / "lighthouse-argv"
        env = {
            "PATH": f"{root / 'bin'}:/usr/bin:/bin",
            **{"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1", "SLURMD_NODENAME": "node1"},
            **{"ARGV_RECORD": str(record), "LIGHTHOUSE_RECORD": str(lighthouse), "SLURM_NODEID": "0"},
        }
        proc = subprocess.run(["bash", str(root / "job.sbatch")], capture_output=True, text=True, env=env, timeout=30)
        assert proc.returncode == 0 and "INJECTED" not in proc.stdout + proc.stderr, proc
        argv = record.read_bytes().decode().split("\0")[:-1]
        assert (
            argv[argv.index("--replica-group") + 1] == "0" and argv[argv.index("--lighthouse") + 1] == "10.0.0.7:10042"
        )
        deadline = time.monotonic() + 10  # the Lighthouse step runs beside the training step: it may come second
        while not lighthouse.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lighthouse.read_bytes().decode().split("\0")[:-1] == [
            "-m",
            "ddptrain",
            "lighthouse",
            "--bind",
            "10.0.0.7:10042",
        ]


def job_script(root: Path, *args: str) -> tuple[int, str]:
    """`ddptrain slurm` in-process from the workspace, with a batch that splits over one group or two."""
    return slurm(root, {"name": "r", "dir": "run"}, "--nodes", "2", *BATCH, *args)
