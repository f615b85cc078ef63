"""What the Kubeflow Training Operator v1.9.0 does to a PyTorchJob, re-stated in Python for the tests.

Read from github.com/kubeflow/training-operator at tag v1.9.0 (commit 6f74c7f6b2ed): defaults in
`pkg/apis/kubeflow.org/v1/pytorch_defaults.go`, admission checks in
`pkg/webhooks/pytorch/pytorchjob_webhook.go`, and the variables appended to every container in
`pkg/controller.v1/pytorch/envvar.go` (setPodEnv), `master.go` and `elastic.go`; the restart
decision for `restartPolicy: ExitCode` in `pkg/controller.v1/common/pod.go` with
`pkg/util/train/train_util.go` (IsRetryableExitCode). The CRD's schema is vendored in
tests/schemas/ (see `validate_schema`).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = Path(__file__).parent / "schemas" / "pytorchjob-v1.9.0.schema.json"
DEFAULT_PORT_NAME, DEFAULT_PORT = "pytorchjob-port", 23456
DEFAULT_CONTAINER = "pytorch"
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _strict(schema: Any) -> Any:
    """The schema with unknown fields rejected (as `kubectl apply --validate=strict` does) instead of pruned."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def schema_errors(job: dict[str, Any]) -> list[str]:
    """Every violation of the PyTorchJob CRD's OpenAPI schema (pod template included), unknown fields too."""
    schema = _strict(json.loads(SCHEMA.read_text()))
    schema.pop("$comment", None)
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(job)]


def webhook_errors(job: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the operator's validating webhook (validatePyTorchJob)."""
    errors: list[str] = []
    warnings: list[str] = []
    name = job["metadata"]["name"]
    if len(name) > 63 or not _DNS_1035.match(name):
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label")
    spec = job["spec"]
    replicas = spec.get("pytorchReplicaSpecs") or {}
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            errors.append("spec.pytorchReplicaSpecs[Worker]: must be configured if elastic policy is used")
        if "nProcPerNode" in elastic:
            warnings.append("spec.elasticPolicy.nProcPerNode is deprecated, use spec.nprocPerNode instead")
            if "nprocPerNode" in spec:
                errors.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    if not replicas:
        errors.append("spec.pytorchReplicaSpecs: must be required")
    for role, rs in replicas.items():
        if role not in ("Master", "Worker"):
            errors.append(f"spec.pytorchReplicaSpecs[{role}]: not supported")
        containers = rs["template"]["spec"].get("containers", [])
        if any(not c.get("image") for c in containers):
            errors.append(f"{role}: image must be required")
        if not any(c.get("name") == DEFAULT_CONTAINER for c in containers):
            errors.append(f"{role}: must have at least one container with name {DEFAULT_CONTAINER}")
        count = rs.get("replicas")
        if role == "Master" and count != 1:
            errors.append("spec.pytorchReplicaSpecs[Master].replicas: must be 1")
        elif count is not None and count < 1:
            errors.append(f"spec.pytorchReplicaSpecs[{role}].replicas: must be at least 1")
    return errors, warnings


def with_defaults(job: dict[str, Any]) -> dict[str, Any]:
    """SetDefaults_PyTorchJob: replicas 1, restartPolicy OnFailure, the default port, elastic min/max, nproc."""
    job = copy.deepcopy(job)
    spec = job["spec"]
    spec.setdefault("runPolicy", {}).setdefault("cleanPodPolicy", "None")
    for rs in spec["pytorchReplicaSpecs"].values():
        rs.setdefault("replicas", 1)
        rs.setdefault("restartPolicy", "OnFailure")
        container = next(c for c in rs["template"]["spec"]["containers"] if c["name"] == DEFAULT_CONTAINER)
        ports = container.setdefault("ports", [])
        if not any(p.get("name") == DEFAULT_PORT_NAME for p in ports):
            ports.append({"name": DEFAULT_PORT_NAME, "containerPort": DEFAULT_PORT})
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
        if lo is None and hi is None:
            lo = hi = spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
        elastic["minReplicas"], elastic["maxReplicas"] = lo if lo is not None else hi, hi if hi is not None else lo
    if elastic is None or "nProcPerNode" not in elastic:
        spec.setdefault("nprocPerNode", "auto")
    return job


def _port(job: dict[str, Any], role: str) -> int:
    container = next(
        c
        for c in job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"]
        if c["name"] == DEFAULT_CONTAINER
    )
    return next(p["containerPort"] for p in container["ports"] if p["name"] == DEFAULT_PORT_NAME)


def injected_env(job: dict[str, Any], role: str, index: int) -> list[tuple[str, str]]:
    """The variables setPodEnv appends, in its order, to each container of replica `role`-`index`."""
    job = with_defaults(job)
    name, spec = job["metadata"]["name"], job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(rs["replicas"] for rs in replicas.values())
    nproc = spec.get("nprocPerNode")
    env = [("PYTHONUNBUFFERED", "1")]
    if "Master" in replicas:
        port, addr = str(_port(job, "Master")), f"{name}-master-0"
        env += [("MASTER_PORT", port), ("PET_MASTER_PORT", port), ("MASTER_ADDR", addr), ("PET_MASTER_ADDR", addr)]
        rank = index + 1 if role == "Worker" else index
        world = total * (int(nproc) if nproc and nproc.isdigit() else 1)
        env += [("WORLD_SIZE", str(world)), ("RANK", str(rank)), ("PET_NODE_RANK", str(rank))]
    if nproc is not None:
        env.append(("PET_NPROC_PER_NODE", nproc))
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        env.append(("PET_NNODES", str(total)))
        return env
    host = elastic.get("rdzvHost", f"{name}-worker-0")
    port = elastic.get("rdzvPort", _port(job, "Worker"))
    env += [
        ("PET_RDZV_ENDPOINT", f"{host}:{port}"),
        ("PET_RDZV_BACKEND", elastic.get("rdzvBackend", "c10d")),
        ("PET_NNODES", f"{elastic['minReplicas']}:{elastic['maxReplicas']}"),
    ]
    if "maxRestarts" in elastic:
        env.append(("PET_MAX_RESTARTS", str(elastic["maxRestarts"])))
    if "nProcPerNode" in elastic:
        env.append(("PET_NPROC_PER_NODE", str(elastic["nProcPerNode"])))
    if "rdzvId" in elastic:
        env.append(("PET_RDZV_ID", elastic["rdzvId"]))
    if elastic.get("rdzvConf"):
        env.append(("PET_RDZV_CONF", ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])))
    if elastic.get("standalone"):
        env.append(("PET_STANDALONE", ""))
    return env


def pod_restarted(restart_policy: str, exit_code: int) -> bool:
    """Whether the operator deletes and recreates a failed pod (pod.go; ExitCode retries codes >= 128 only)."""
    if restart_policy == "ExitCode":
        return exit_code >= 128
    return restart_policy in ("OnFailure", "Always")
