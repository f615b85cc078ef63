"""`ddptrain k8s`: a PyTorchJob the Kubeflow Training Operator v1.9.0 accepts and runs as intended.

Checked against the CRD's OpenAPI schema (vendored, pod template included, unknown fields
rejected), the operator's webhook rules, and the variables the operator injects into each replica
(tests/kubeflow_operator.py re-states its source).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubeflow_operator import injected_env, pod_restarted, schema_errors, webhook_errors

from ddptrain.cli import main


def _manifest(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, list[dict[str, Any]]]:
    """`ddptrain k8s` in-process: (exit code, stderr, the YAML documents it printed)."""
    rc = main(["k8s", "--image", "registry.example/ddptrain:1", *args])
    out, err = capsys.readouterr()
    return rc, err, list(yaml.safe_load_all(out)) if rc == 0 else []


def _option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _check_against_operator(job: dict[str, Any]) -> None:
    """Schema-valid, webhook-clean, and every replica's command agrees with what the operator injects."""
    assert schema_errors(job) == []
    errors, warnings = webhook_errors(job)
    assert errors == [] and warnings == []
    name = job["metadata"]["name"]
    for role, rs in job["spec"]["pytorchReplicaSpecs"].items():
        for index in range(rs["replicas"]):
            env = dict(injected_env(job, role, index))
            (c,) = rs["template"]["spec"]["containers"]
            cmd = c["command"]
            assert _option(cmd, "--nnodes") == env["PET_NNODES"]
            assert _option(cmd, "--nproc-per-node") == env["PET_NPROC_PER_NODE"]
            if "--rdzv-endpoint" in cmd:  # several nodes: the rendezvous the operator names is the one used
                assert _option(cmd, "--rdzv-endpoint") == env["PET_RDZV_ENDPOINT"]
                assert _option(cmd, "--run-id") == env["PET_RDZV_ID"]
                assert _option(cmd, "--max-restarts") == env["PET_MAX_RESTARTS"]
                backend = _option(cmd, "--rdzv-backend") if "--rdzv-backend" in cmd else "c10d"
                assert backend == env["PET_RDZV_BACKEND"]
                host = env["PET_RDZV_ENDPOINT"].rsplit(":", 1)[0]
                # c10d: exactly one pod (the Master) advertises the endpoint's host, so exactly one hosts the
                # store; etcd: none does (the store is etcd's)
                assert (_option(cmd, "--node-addr") == host) == (role == "Master" and backend == "c10d")
            assert env["MASTER_ADDR"] == f"{name}-master-0"


def test_gpu_job_runs_one_rank_per_gpu_and_matches_the_operator(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, docs = _manifest(
        capsys,
        "train.max_steps=9",
        "train.global_batch_size=1536",
        "--nodes",
        "4",
        "--min-nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--pvc",
        "team-runs",
        "--save-seconds",
        "120",
        "--step-seconds",
        "10",
    )
    assert rc == 0, err
    config_map, job = docs
    assert config_map["kind"] == "ConfigMap" and "max_steps: 9" in config_map["data"]["config.yaml"]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    _check_against_operator(job)
    name, spec = job["metadata"]["name"], job["spec"]
    assert spec["nprocPerNode"] == "8"  # not the deprecated elasticPolicy.nProcPerNode
    assert spec["elasticPolicy"] == {
        "rdzvBackend": "c10d",
        "rdzvHost": f"{name}-master-0",
        "rdzvPort": 29400,
        "rdzvId": name,
        "minReplicas": 2,
        "maxReplicas": 4,
        "maxRestarts": 3,
    }
    assert "backoffLimit" not in spec["runPolicy"]
    replicas = spec["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    for rs in replicas.values():
        assert rs["restartPolicy"] == "ExitCode"
        pod = rs["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 160  # step 10 + save 120 + worker margin 10 + launcher 20
        (c,) = pod["containers"]
        cmd = c["command"]
        assert cmd[:2] == ["ddptrain", "launch"] and _option(cmd, "--shutdown-timeout") == "140"
        assert _option(cmd, "--preempted-exit-code") == "143" and cmd[-4:] == [
            "--",
            "train",
            "-c",
            "/etc/ddptrain/config.yaml",
        ]
        for kind in ("requests", "limits"):  # scaled with the ranks: 4 CPUs and 16Gi each
            assert c["resources"][kind] == {"cpu": "32", "memory": "128Gi", "nvidia.com/gpu": 8}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert volumes["run-dir"]["persistentVolumeClaim"]["claimName"] == "team-runs"
        assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]


def test_one_node_job_is_a_lone_master_without_elastic_policy(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, docs = _manifest(capsys, "--nodes", "1", "--gpus-per-node", "2")
    assert rc == 0, err
    job = docs[1]
    _check_against_operator(job)
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"} and "elasticPolicy" not in job["spec"]
    cmd = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert "--rdzv-endpoint" not in cmd and _option(cmd, "--nproc-per-node") == "2"


def test_scheduling_options(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err, docs = _manifest(
        capsys,
        "--nodes",
        "2",
        "--toleration",
        "nvidia.com/gpu:NoSchedule",
        "--toleration",
        "pool=a100:NoExecute",
        "--node-selector",
        "gpu=a100",
        "--priority-class",
        "training",
        "--gang",
        "volcano",
        "--queue",
        "research",
        "--shm-size",
        "1Gi",
        "--cpu",
        "6",
        "--memory",
        "20Gi",
    )
    assert rc == 0, err
    job = docs[1]
    _check_against_operator(job)
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {
        "minAvailable": 2,
        "queue": "research",
        "priorityClass": "training",
    }
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["schedulerName"] == "volcano" and pod["priorityClassName"] == "training"
    assert pod["nodeSelector"] == {"gpu": "a100"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "pool", "operator": "Equal", "value": "a100", "effect": "NoExecute"},
    ]
    assert pod["containers"][0]["resources"]["limits"] == {"cpu": "6", "memory": "20Gi"}
    rc, err, docs = _manifest(capsys, "--nodes", "2", "--gang", "kueue", "--queue", "team-a")
    assert rc == 0, err
    _check_against_operator(docs[1])
    assert docs[1]["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"}


def test_restart_policy_retries_preemption_and_not_crashes() -> None:
    """Under the operator's ExitCode policy the preempted code restarts the pod; crashes and bad input end the job."""
    assert pod_restarted("ExitCode", 143) and pod_restarted("ExitCode", 137)
    assert not pod_restarted("ExitCode", 1) and not pod_restarted("ExitCode", 2) and not pod_restarted("ExitCode", 75)


def test_schema_check_catches_what_it_should() -> None:
    """The vendored schema is not vacuous: a wrong type, an unknown field and a deprecated layout are caught."""
    job: dict[str, Any] = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "x"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": "one",
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "i", "bogus": 1}]}},
                }
            }
        },
    }
    errors = schema_errors(job)
    assert any("replicas" in e for e in errors) and any("bogus" in e for e in errors)
    job["spec"]["elasticPolicy"] = {"nProcPerNode": 8}
    job["spec"]["nprocPerNode"] = "8"
    errors, warnings = webhook_errors(job)
    assert any("Worker" in e for e in errors) and any("nProcPerNode" in e for e in errors) and warnings


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--grace-seconds", "30"], "--grace-seconds=30 s is shorter"),
        (["--min-nodes", "3", "--nodes", "2"], "--min-nodes 3 must be between"),
        (["run.name=Big_Run!"], "is not a DNS-1035 label"),
        (["--name", "9lives"], "is not a DNS-1035 label"),
        (["ckpt.resume=never"], "use ckpt.resume=auto"),
        (["--gpus-per-node", "8", "--nproc-per-node", "3"], "must be equal"),
        (["--nodes", "3", "train.global_batch_size=32"], "is not divisible"),
        (["--memory", "lots"], "is not a Kubernetes quantity"),
        (["--shm-size", "32Gi", "--memory", "16Gi"], "must be below --memory"),
        (["--toleration", "a:Sometimes"], "--toleration 'a:Sometimes'"),
        (["--node-selector", "novalue"], "--node-selector 'novalue'"),
        (["--gang", "kueue"], "needs --queue"),
        (["--nodes", "2", "--etcd-service", "etcd:http"], "--etcd-service: 'etcd:http' has no valid port"),
        (["--nodes", "2", "--etcd-service", "etcd-0,etcd-1"], "give one Service"),
        (["--etcd-service", "etcd"], "needs --nodes 2 or more"),
    ],
)
def test_bad_input_is_refused(capsys: pytest.CaptureFixture[str], bad: list[str], message: str) -> None:
    rc, err, _ = _manifest(capsys, *bad)
    assert rc == 2 and message in err and err.count("\n") == 1, (bad, err)


def test_etcd_service_rendezvous(capsys: pytest.CaptureFixture[str]) -> None:
    """--etcd-service: every pod meets in etcd (etcd-v2), none hosts a store, and the operator says the same."""
    rc, err, docs = _manifest(capsys, "--nodes", "2", "--min-nodes", "1", "--etcd-service", "etcd-client.infra")
    assert rc == 0, err
    job = docs[1]
    policy = job["spec"]["elasticPolicy"]
    assert (policy["rdzvBackend"], policy["rdzvHost"], policy["rdzvPort"]) == ("etcd-v2", "etcd-client.infra", 2379)
    _check_against_operator(job)
    for rs in job["spec"]["pytorchReplicaSpecs"].values():
        cmd = rs["template"]["spec"]["containers"][0]["command"]
        assert _option(cmd, "--rdzv-endpoint") == "etcd-client.infra:2379"
        assert _option(cmd, "--node-addr") == "$(POD_IP)"


@settings(max_examples=25, deadline=None)
@given(nodes=st.integers(1, 6), gpus=st.sampled_from([0, 1, 2, 4, 8]), elastic=st.booleans())
def test_every_shape_is_valid_for_the_operator(nodes: int, gpus: int, elastic: bool) -> None:
    procs = gpus or 1
    args = [
        "k8s",
        "--image",
        "i:1",
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        str(gpus),
        f"train.global_batch_size={16 * procs * 60}",
        "data.micro_batch_size=16",
    ]
    if elastic:
        args += ["--min-nodes", "1"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    _check_against_operator(list(yaml.safe_load_all(out.getvalue()))[1])


@pytest.mark.parametrize(("args", "claim"), [([], "ddptrain-default-runs"), (["--pvc", "team-runs"], "team-runs")])
def test_the_manifest_names_the_claim_it_needs_and_never_creates_it(
    capsys: pytest.CaptureFixture[str], args: list[str], claim: str
) -> None:
    assert main(["k8s", "--image", "registry.example/ddptrain:1", "--shared-mount", "/data", *args]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith(f"# Needs the PersistentVolumeClaim {claim} (ReadWriteMany; mounted at /data")
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]  # deleting the job leaves the claim
    volumes = docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert {"name": "run-dir", "persistentVolumeClaim": {"claimName": claim}} in volumes
