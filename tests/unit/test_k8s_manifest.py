"""`ddptrain k8s`: the manifest is YAML with what the Kubeflow Training Operator requires."""

from __future__ import annotations

from typing import Any

import yaml

import pytest

from ddptrain.cli import main


def _manifest(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, list[dict[str, Any]]]:
    """`ddptrain k8s` in-process: (exit code, stderr, the YAML documents it printed)."""
    rc = main(["k8s", "--image", "registry.example/ddptrain:1", *args])
    out, err = capsys.readouterr()
    return rc, err, list(yaml.safe_load_all(out)) if rc == 0 else []


def test_pytorchjob_has_operator_fields(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, docs = _manifest(capsys, "train.max_steps=9", "--nodes", "4", "--min-nodes", "2",
                              "--nproc-per-node", "8", "--gpus-per-node", "8", "--cpu", "32", "--memory", "200Gi",
                              "--pvc", "team-runs", "--save-seconds", "120", "--step-seconds", "10")
    assert rc == 0, err
    config_map, job = docs
    assert config_map["kind"] == "ConfigMap" and "max_steps: 9" in config_map["data"]["config.yaml"]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    name = job["metadata"]["name"]
    spec = job["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 4, "maxRestarts": 3,
                                     "nProcPerNode": 8}
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    for role, rs in replicas.items():
        assert rs["restartPolicy"] in ("OnFailure", "Always", "ExitCode", "Never")
        pod = rs["template"]["spec"]
        # step 10 + save 120 + worker margin 10 + launcher margin 20
        assert pod["terminationGracePeriodSeconds"] == 160
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "registry.example/ddptrain:1"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PET_NNODES"] == "2:4" and env["PET_NPROC_PER_NODE"] == "8"
        assert env["PET_RDZV_BACKEND"] == "c10d" and env["PET_RDZV_ENDPOINT"] == f"{name}-master-0:29400"
        assert c["command"][:2] == ["ddptrain", "launch"]
        assert c["command"][c["command"].index("--shutdown-timeout") + 1] == "140"  # step + save + 10
        assert c["command"][-4:] == ["--", "train", "-c", "/etc/ddptrain/config.yaml"]
        node_addr = c["command"][c["command"].index("--node-addr") + 1]
        assert node_addr == (f"{name}-master-0" if role == "Master" else "$(POD_IP)")
        for kind in ("requests", "limits"):
            assert c["resources"][kind] == {"cpu": "32", "memory": "200Gi", "nvidia.com/gpu": 8}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert c["workingDir"] == mounts["run-dir"] == "/shared"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["run-dir"]["persistentVolumeClaim"]["claimName"] == "team-runs"
        assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]


def test_one_node_job_has_no_workers_and_bad_input_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, docs = _manifest(capsys, "--nodes", "1")
    assert rc == 0, err
    assert set(docs[1]["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    for bad, message in ((["--grace-seconds", "30"], "--grace-seconds=30 s is shorter"),
                         (["--min-nodes", "3", "--nodes", "2"], "--min-nodes 3 must be between"),
                         (["run.name=Big_Run!"], "is not a DNS label"),
                         (["ckpt.resume=never"], "use ckpt.resume=auto")):
        rc, err, _ = _manifest(capsys, *bad)
        assert rc == 2 and message in err, (bad, err)
