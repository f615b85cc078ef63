"""`ddptrain k8s`: a Kubeflow Training Operator PyTorchJob (plus a ConfigMap with the frozen config).

One Master and nodes-1 Worker replicas run the same `ddptrain launch` line. Kubernetes itself
expands the `$(PET_...)` and `$(POD_IP)` references in the command from the container's
environment, so what each pod runs is fully visible in the manifest. The Master advertises the
name of its headless Service (`<job>-master-0`, which the operator creates and which is the
rendezvous host), so it hosts the c10d rendezvous; workers advertise their pod IP.

run.dir lives on a ReadWriteMany PersistentVolumeClaim mounted as the working directory, so a
restarted or rescheduled pod resumes from the newest checkpoint there (ckpt.resume=auto).
`terminationGracePeriodSeconds` covers finishing a step, committing a checkpoint and the
launcher's shutdown, so an eviction's SIGTERM ends in a committed checkpoint and exit 75, not a
SIGKILL half-way through a save.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from ddptrain.config import Config
from ddptrain.errors import ConfigError
from ddptrain.jobspec import check_stop_window, launch_argv, stop_budget_s, worker_stop_s

CONTAINER = "pytorch"  # the operator finds the training container by this name
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$")


@dataclass(frozen=True)
class K8sJob:
    """The replicas, resources and volumes of one PyTorchJob."""

    image: str
    name: str | None = None
    namespace: str | None = None
    nodes: int = 2
    min_nodes: int | None = None
    nproc_per_node: int = 1
    cpu: str = "4"
    memory: str = "16Gi"
    gpus_per_node: int = 0
    pvc: str | None = None
    shared_mount: str = "/shared"
    config_mount: str = "/etc/ddptrain"
    max_restarts: int = 3
    rdzv_port: int = 29400
    step_s: float = 30.0
    save_s: float = 60.0
    grace_s: int | None = None

    def job_name(self, cfg: Config) -> str:
        """The PyTorchJob name (a DNS label; Service and pod names derive from it)."""
        name = self.name or f"ddptrain-{cfg.run.name}".lower().replace("_", "-")
        if not _DNS_LABEL.match(name):
            raise ConfigError(f"job name {name!r} is not a DNS label of at most 42 characters (a-z, 0-9, '-'); pass --name")
        return name

    def grace_period(self) -> int:
        """terminationGracePeriodSeconds: the given one (checked) or the stop budget."""
        needed = stop_budget_s(self.step_s, self.save_s)
        if self.grace_s is None:
            return needed
        check_stop_window(self.grace_s, needed, "--grace-seconds")
        return self.grace_s

    def validate(self) -> None:
        """Refuse replica counts the operator would reject."""
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise ConfigError("--nodes and --nproc-per-node must be at least 1")
        min_nodes = self.min_nodes or self.nodes
        if not 1 <= min_nodes <= self.nodes:
            raise ConfigError(f"--min-nodes {min_nodes} must be between 1 and --nodes {self.nodes}")
        if not self.shared_mount.startswith("/") or not self.config_mount.startswith("/"):
            raise ConfigError("--shared-mount and --config-mount must be absolute paths")


class _Dumper(yaml.SafeDumper):
    """Plain YAML for humans and kubectl: no anchors, multi-line strings as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _resources(job: K8sJob) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": job.cpu, "memory": job.memory}
    if job.gpus_per_node:
        amounts["nvidia.com/gpu"] = job.gpus_per_node
    # requests == limits: the Guaranteed QoS class, the last to be evicted under node pressure.
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _replica(job: K8sJob, name: str, role: str, replicas: int, env: list[dict[str, Any]]) -> dict[str, Any]:
    node_addr = f"{name}-master-0" if role == "Master" else "$(POD_IP)"
    command = ["ddptrain", *launch_argv(
        nnodes="$(PET_NNODES)", nproc_per_node="$(PET_NPROC_PER_NODE)", endpoint="$(PET_RDZV_ENDPOINT)",
        run_id="$(PET_RDZV_ID)", node_addr=node_addr, max_restarts=job.max_restarts,
        shutdown_s=worker_stop_s(job.step_s, job.save_s), config_path=f"{job.config_mount}/config.yaml",
    )]
    return {
        "replicas": replicas,
        # OnFailure: the kubelet restarts a container that exits non-zero (75 after a coordinated
        # stop, or a crash) in place; runPolicy.backoffLimit bounds the crashes.
        "restartPolicy": "OnFailure",
        "template": {"spec": {
            "terminationGracePeriodSeconds": job.grace_period(),
            "containers": [{
                "name": CONTAINER,
                "image": job.image,
                "workingDir": job.shared_mount,
                "command": command,
                "env": env,
                "ports": [{"name": "pytorchjob-port", "containerPort": job.rdzv_port}],
                "resources": _resources(job),
                "volumeMounts": [
                    {"name": "run-dir", "mountPath": job.shared_mount},
                    {"name": "config", "mountPath": job.config_mount, "readOnly": True},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                ],
            }],
            "volumes": [
                {"name": "run-dir", "persistentVolumeClaim": {"claimName": job.pvc or f"{name}-runs"}},
                {"name": "config", "configMap": {"name": f"{name}-config"}},
                # DataLoader workers pass batches through shared memory; the container default is 64 MB.
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        }},
    }


def render_manifest(cfg: Config, job: K8sJob) -> str:
    """Two YAML documents: the ConfigMap holding the frozen config, and the PyTorchJob."""
    job.validate()
    name = job.job_name(cfg)
    min_nodes = job.min_nodes or job.nodes
    nnodes = str(job.nodes) if min_nodes == job.nodes else f"{min_nodes}:{job.nodes}"
    meta: dict[str, Any] = {"name": name, **({"namespace": job.namespace} if job.namespace else {})}
    # The variables torchrun reads (PET_<FLAG>); the operator sets the same ones for elastic jobs.
    env: list[dict[str, Any]] = [
        {"name": "PET_NNODES", "value": nnodes},
        {"name": "PET_NPROC_PER_NODE", "value": str(job.nproc_per_node)},
        {"name": "PET_RDZV_BACKEND", "value": "c10d"},
        {"name": "PET_RDZV_ENDPOINT", "value": f"{name}-master-0:{job.rdzv_port}"},
        {"name": "PET_RDZV_ID", "value": name},
        {"name": "PET_MAX_RESTARTS", "value": str(job.max_restarts)},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "OMP_NUM_THREADS", "value": "1"},
    ]
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{name}-config"},
        "data": {"config.yaml": cfg.to_yaml()},
    }
    spec: dict[str, Any] = {
        "elasticPolicy": {
            "rdzvBackend": "c10d", "minReplicas": min_nodes, "maxReplicas": job.nodes,
            "maxRestarts": job.max_restarts, "nProcPerNode": job.nproc_per_node,
        },
        "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": job.max_restarts},
        "pytorchReplicaSpecs": {"Master": _replica(job, name, "Master", 1, env)},
    }
    if job.nodes > 1:
        spec["pytorchReplicaSpecs"]["Worker"] = _replica(job, name, "Worker", job.nodes - 1, env)
    pytorch_job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta, "spec": spec}
    header = f"# Generated by `ddptrain k8s` for run {cfg.run.name}. Apply with: kubectl apply -f THIS_FILE\n"
    return header + yaml.dump_all([config_map, pytorch_job], Dumper=_Dumper, sort_keys=False, width=1000)
