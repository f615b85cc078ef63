"""`ddptrain slurm` and `ddptrain k8s` with --fault-tolerance torchft: the Lighthouse beside the job, one replica
group per node, read back from the script and the manifest and run as far as this machine allows."""

from __future__ import annotations

import contextlib
import io
import shlex
import subprocess
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
# A real training step lasts the whole job; the stub's would end at once, and the job's end stops the
# Lighthouse step, on a busy machine before it has started: the stub training step waits for the
# Lighthouse's whole record (5 words) first (bounded), so the order is the same on any machine.
STUB_SRUN_FT = """#!/bin/bash
while [ "$#" -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
if [ "$1" = bash ]; then
    for _ in $(seq 1200); do
        [ -f "$LIGHTHOUSE_RECORD" ] && [ "$(tr -cd '\\0' < "$LIGHTHOUSE_RECORD" | wc -c)" -ge 5 ] && break
        sleep 0.05
    done
    exec "$@"
fi
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
