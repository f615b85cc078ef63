"""`ddptrain k8s`: a Kubeflow Training Operator PyTorchJob (plus a ConfigMap with the frozen config).

Written against the operator's v1 API as of release v1.9.0 (its `pkg/controller.v1/pytorch/`
`envvar.go`, `elastic.go`, `master.go` and the webhook `pkg/webhooks/pytorch/pytorchjob_webhook.go`):

* One Master and nodes-1 Worker replicas run the same `ddptrain launch` line with literal values.
  The operator appends its own variables to every container (`PET_RDZV_ENDPOINT`, `PET_NNODES`,
  `PET_NPROC_PER_NODE`, `PET_RDZV_ID`, `PET_MAX_RESTARTS`, `MASTER_ADDR`, `RANK`, ...); the
  `elasticPolicy` here (`rdzvHost`/`rdzvPort`/`rdzvId`, `minReplicas`/`maxReplicas`) and
  `spec.nprocPerNode` are set so that what it injects says exactly what the command line says.
  Without `rdzvHost` it would point the endpoint at `<job>-worker-0`, which hosts nothing.
* With `--etcd-service` the rendezvous is an existing etcd cluster's (etcd-v2 backend): every
  pod advertises its IP and none is special. Otherwise the Master hosts the c10d rendezvous: its `--node-addr` is its Service name `<job>-master-0`
  (the operator creates a headless Service per replica), the host of the endpoint; workers
  advertise their pod IP.
* One node: the webhook rejects an `elasticPolicy` without a Worker replica, so a one-node job is
  a lone Master without one, whose launcher hosts a local rendezvous.
* Restarts: `restartPolicy: ExitCode`. The operator then recreates a pod whose container exited
  with 128 or more and fails the job on 1-127, without counting recreations against
  `backoffLimit`. So the launcher reports a preemption (checkpoint committed) as 143 (128 +
  SIGTERM, what Kubernetes records for a container stopped by SIGTERM): an eviction, a Kueue
  preemption or a node drain restarts the job and resumes it, as often as it happens. A crash is
  retried in the pod by the launcher (`--max-restarts`, the crash budget) and then fails the job
  with 1; bad input fails it with 2 at once.

run.dir lives on a ReadWriteMany PersistentVolumeClaim mounted as the working directory, so a
restarted or rescheduled pod resumes from the newest checkpoint there (ckpt.resume=auto).
`terminationGracePeriodSeconds` covers finishing a step, committing a checkpoint and the
launcher's shutdown, so an eviction's SIGTERM ends in a committed checkpoint, not a SIGKILL
half-way through a save.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import yaml

from ddptrain.checks import script_text
from ddptrain.cli_options import option
from ddptrain.config import Config
from ddptrain.endpoints import format_endpoint
from ddptrain.errors import ConfigError
from ddptrain.etcd_endpoints import parse_endpoints
from ddptrain.launch.jobspec import ETCD_BACKEND, JobSpec, check_config_texts, check_stop_window, launch_argv
from ddptrain.launch.k8s_lighthouse import LIGHTHOUSE_PORT, lighthouse_objects
from ddptrain.launch.options import LaunchOptions
from ddptrain.launch.quantities import k8s_quantity

OPERATOR_VERSION = "v1.9.0"  # the Kubeflow Training Operator release whose source this follows
CONTAINER = "pytorch"  # the operator finds the training container by this name
PORT_NAME = "pytorchjob-port"  # ... and its port by this one
# 128 + SIGTERM: the operator's ExitCode policy recreates pods that exit with >= 128.
PREEMPTED_EXIT_CODE = 143
# Per process (GPU) unless given: CPUs for the rank and its data loading, memory, and /dev/shm.
CPU_PER_PROC = 4
MEMORY_GI_PER_PROC = 16
SHM_GI_PER_PROC = 2
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,40}[a-z0-9])?$")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class K8sJob(JobSpec):
    """The replicas, resources, scheduling and volumes of one PyTorchJob (each field is a `ddptrain k8s` option)."""

    node: ClassVar[str] = "pod"

    image: str = option(None, "container image with ddptrain installed", required=True)
    name: str | None = option(None, "job name (default ddptrain-<run.name>)")
    namespace: str | None = option(None, "Kubernetes namespace")
    min_nodes: int | None = option(None, "elastic minimum of pods (default --nodes: not elastic)", parse=int)
    cpu: str | None = option(None, f"CPU request and limit per pod (default {CPU_PER_PROC} per rank)")
    memory: str | None = option(None, f"memory request and limit per pod (default {MEMORY_GI_PER_PROC}Gi per rank)")
    shm_size: str | None = option(
        None, f"size limit of the memory-backed /dev/shm (default {SHM_GI_PER_PROC}Gi per rank)"
    )
    pvc: str | None = option(None, "ReadWriteMany PVC holding run.dir (default <name>-runs)")
    shared_mount: str = option("/shared", "mount path of the PVC; the working directory")
    config_mount: str = option("/etc/ddptrain", "mount path of the config ConfigMap")
    max_restarts: int = option(
        LaunchOptions.max_restarts, "in-pod worker-group restarts after crashes (the crash budget)"
    )
    rdzv_port: int = option(29400, "rendezvous port on the master pod")
    etcd_service: str | None = option(
        None,
        "rendezvous through an existing etcd cluster instead of on the master pod: its client Service, "
        "NAME[.NAMESPACE][:PORT] (port 2379 when left out); losing any pod then leaves the others training",
    )
    grace_s: int | None = option(
        None, "terminationGracePeriodSeconds (default: the stop budget)", flag="--grace-seconds", parse=int
    )
    tolerations: tuple[str, ...] = option(
        (), "toleration KEY[=VALUE][:EFFECT], repeatable", flag="--toleration", repeat=True
    )
    node_selector: tuple[str, ...] = option((), "node label KEY=VALUE pods must have, repeatable", repeat=True)
    priority_class: str | None = option(None, "PriorityClass of the pods")
    gang: str = option(
        "none",
        "gang scheduling: kueue (queue label) or volcano (scheduler + PodGroup)",
        choices=("none", "kueue", "volcano"),
    )
    queue: str | None = option(None, "Kueue LocalQueue or Volcano queue (required with --gang kueue)")

    def job_name(self, cfg: Config) -> str:
        """The PyTorchJob name (a DNS-1035 label as the webhook requires; Service and pod names derive from it)."""
        name = self.name or f"ddptrain-{cfg.run.name}".lower().replace("_", "-")
        if not _DNS_1035.match(name):
            raise ConfigError(
                f"job name {name!r} is not a DNS-1035 label of at most 42 characters "
                "(a-z first, then a-z, 0-9, '-'); pass --name"
            )
        return name

    def grace_period(self) -> int:
        """terminationGracePeriodSeconds: the given one (checked) or the stop budget."""
        needed = self.stop_budget_s()
        if self.grace_s is None:
            return needed
        check_stop_window(self.grace_s, needed, "--grace-seconds")
        return self.grace_s

    def etcd(self) -> tuple[str, int] | None:
        """(host, port) of the etcd Service (checked: one, and a job of several pods), or None."""
        if self.etcd_service is None:
            return None
        members = parse_endpoints("--etcd-service", self.etcd_service)
        if len(members) != 1:
            raise ConfigError(f"--etcd-service {self.etcd_service!r}: give one Service (it spreads over the members)")
        if self.nodes < 2:
            raise ConfigError("--etcd-service needs --nodes 2 or more: a one-pod job has nobody to meet")
        return members[0]

    def cpu_amount(self) -> str:
        """CPU request and limit of each pod."""
        return self.cpu or str(CPU_PER_PROC * self.procs)

    def memory_amount(self) -> str:
        """Memory request and limit of each pod."""
        return self.memory or f"{MEMORY_GI_PER_PROC * self.procs}Gi"

    def shm_amount(self) -> str:
        """Size limit of /dev/shm (it is memory and counts against the pod's memory limit)."""
        return self.shm_size or f"{SHM_GI_PER_PROC * self.procs}Gi"

    def validate(self, cfg: Config) -> None:
        """Refuse what the operator, the API server or the first training step would reject."""
        if self.nodes < 1 or (self.nproc_per_node is not None and self.nproc_per_node < 1) or self.gpus_per_node < 0:
            raise ConfigError("--nodes and --nproc-per-node must be at least 1, --gpus-per-node at least 0")
        min_nodes = self.min_nodes or self.nodes
        if not 1 <= min_nodes <= self.nodes:
            raise ConfigError(f"--min-nodes {min_nodes} must be between 1 and --nodes {self.nodes}")
        self.check_fault_tolerance(self.min_nodes, self.etcd_service, "--etcd-service")
        self.check_ranks(cfg, 1 if self.fault_tolerance else min_nodes)  # in place: down to one group
        if not self.shared_mount.startswith("/") or not self.config_mount.startswith("/"):
            raise ConfigError("--shared-mount and --config-mount must be absolute paths")
        if not self.image.strip() or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image {self.image!r} must be an image reference without spaces")
        texts = {
            "--image": self.image,
            "--shared-mount": self.shared_mount,
            "--config-mount": self.config_mount,
            "--name": self.name,
            "--namespace": self.namespace,
            "--cpu": self.cpu,
            "--memory": self.memory,
            "--shm-size": self.shm_size,
            "--pvc": self.pvc,
            "--priority-class": self.priority_class,
            "--queue": self.queue,
        }
        for flag, value in texts.items():
            if value is not None:
                script_text(flag, value)  # a newline would end the header comment and start YAML of its own
        if not 0 < self.rdzv_port < 65536:
            raise ConfigError(f"--rdzv-port {self.rdzv_port} is not a TCP port")
        if self.etcd_service is not None:
            self.etcd()
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be >= 0")
        k8s_quantity(self.cpu_amount(), "--cpu")
        memory = k8s_quantity(self.memory_amount(), "--memory")
        if k8s_quantity(self.shm_amount(), "--shm-size") >= memory:
            raise ConfigError(
                f"--shm-size {self.shm_amount()} must be below --memory {self.memory_amount()}: "
                "/dev/shm is memory charged to the pod"
            )
        if self.gang == "kueue" and not self.queue:
            raise ConfigError("--gang kueue needs --queue LOCAL_QUEUE (the Kueue LocalQueue in the job's namespace)")
        if self.gang == "none" and self.queue:
            raise ConfigError("--queue needs --gang kueue or --gang volcano")
        tolerations(self.tolerations)
        node_selector(self.node_selector)


def tolerations(specs: tuple[str, ...]) -> list[dict[str, str]]:
    """Pod tolerations from KEY[=VALUE][:EFFECT] (kubectl taint's notation); exit 2 on a malformed one."""
    out = []
    for spec in specs:
        body, _, effect = spec.partition(":")
        key, eq, value = body.partition("=")
        if not _LABEL_KEY.match(key) or (eq and not _LABEL_VALUE.match(value)) or (effect and effect not in _EFFECTS):
            raise ConfigError(
                f"--toleration {spec!r} must be KEY[=VALUE][:EFFECT] with EFFECT one of {', '.join(_EFFECTS)}"
            )
        item = {"key": key, "operator": "Equal" if eq else "Exists"}
        if eq:
            item["value"] = value
        if effect:
            item["effect"] = effect
        out.append(item)
    return out


def node_selector(specs: tuple[str, ...]) -> dict[str, str]:
    """The pods' nodeSelector from KEY=VALUE items; exit 2 on a malformed one."""
    out = {}
    for spec in specs:
        key, eq, value = spec.partition("=")
        if not eq or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ConfigError(f"--node-selector {spec!r} must be KEY=VALUE (a node label)")
        out[key] = value
    return out


class _Dumper(yaml.SafeDumper):
    """Plain YAML for humans and kubectl: no anchors, multi-line strings as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _resources(job: K8sJob) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": job.cpu_amount(), "memory": job.memory_amount()}
    if job.gpus_per_node:
        amounts["nvidia.com/gpu"] = job.gpus_per_node
    # requests == limits: the Guaranteed QoS class, the last to be evicted under node pressure.
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _command(job: K8sJob, name: str, role: str) -> list[str]:
    if job.fault_tolerance is not None:
        return _in_place_command(job, name)
    multi = job.nodes > 1
    min_nodes = job.min_nodes or job.nodes
    master = f"{name}-master-0"
    etcd = job.etcd()
    if etcd is not None:
        # No pod hosts anything: every one advertises its IP and meets the others in etcd.
        endpoint, node_addr, backend = format_endpoint(etcd), "$(POD_IP)", ETCD_BACKEND
    else:
        endpoint, node_addr = f"{master}:{job.rdzv_port}", master if role == "Master" else "$(POD_IP)"
        backend = None
    return [
        "ddptrain",
        *launch_argv(
            nnodes=f"{min_nodes}:{job.nodes}" if multi else "1",  # the operator's PET_NNODES, character for character
            nproc_per_node=str(job.procs),
            endpoint=endpoint if multi else None,
            run_id=name if multi else None,
            node_addr=node_addr if multi else None,
            max_restarts=job.max_restarts,
            shutdown_s=job.worker_stop_s(),
            # The kubelet expands $(VAR) in a command and reads $$ as one $: a $ in the path stays a $.
            config_path=f"{job.config_mount}/config.yaml".replace("$", "$$"),
            preempted_exit_code=PREEMPTED_EXIT_CODE,
            rdzv_backend=backend,
        ),
    ]


def _in_place_command(job: K8sJob, name: str) -> list[str]:
    """Each pod's launch is one replica group, its id the replica index the operator injects (Master 0,
    Worker i: i+1), meeting the others at the Lighthouse's Service."""
    return [
        "ddptrain",
        *launch_argv(
            nnodes="1",
            nproc_per_node=str(job.procs),
            endpoint=None,
            run_id=None,
            node_addr="$(POD_IP)",
            max_restarts=job.max_restarts,
            shutdown_s=job.worker_stop_s(),
            config_path=f"{job.config_mount}/config.yaml".replace("$", "$$"),
            preempted_exit_code=PREEMPTED_EXIT_CODE,
            lighthouse=(f"{name}-lighthouse:{LIGHTHOUSE_PORT}", "$(PET_NODE_RANK)"),
        ),
    ]


def _pod_spec(job: K8sJob, name: str, role: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": job.grace_period()}
    if job.priority_class:
        spec["priorityClassName"] = job.priority_class
    if job.gang == "volcano":
        spec["schedulerName"] = "volcano"
    if job.node_selector:
        spec["nodeSelector"] = node_selector(job.node_selector)
    if job.tolerations:
        spec["tolerations"] = tolerations(job.tolerations)
    spec["containers"] = [
        {
            "name": CONTAINER,
            "image": job.image,
            "workingDir": job.shared_mount,
            "command": _command(job, name, role),
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "ports": [{"name": PORT_NAME, "containerPort": job.rdzv_port}],
            "resources": _resources(job),
            "volumeMounts": [
                {"name": "run-dir", "mountPath": job.shared_mount},
                {"name": "config", "mountPath": job.config_mount, "readOnly": True},
                {"name": "dshm", "mountPath": "/dev/shm"},
            ],
        }
    ]
    spec["volumes"] = [
        {"name": "run-dir", "persistentVolumeClaim": {"claimName": job.pvc or f"{name}-runs"}},
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        # DataLoader workers pass batches through shared memory (the container default is 64 MB);
        # bounded, since it is RAM charged to the pod.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_amount()}},
    ]
    return spec


def _replica(job: K8sJob, name: str, role: str, replicas: int) -> dict[str, Any]:
    # ExitCode: the operator recreates pods that exit >= 128 (preempted: 143) and fails the job otherwise.
    return {"replicas": replicas, "restartPolicy": "ExitCode", "template": {"spec": _pod_spec(job, name, role)}}


def pytorch_job(cfg: Config, job: K8sJob) -> dict[str, Any]:
    """The PyTorchJob object (validated)."""
    job.validate(cfg)
    check_config_texts(cfg)
    name = job.job_name(cfg)
    metadata: dict[str, Any] = {"name": name, **({"namespace": job.namespace} if job.namespace else {})}
    if job.gang == "kueue":
        metadata["labels"] = {KUEUE_QUEUE_LABEL: job.queue}
    run_policy: dict[str, Any] = {"cleanPodPolicy": "Running"}  # a finished job frees its GPUs, keeps logs
    if job.gang == "volcano":
        run_policy["schedulingPolicy"] = {
            "minAvailable": job.min_nodes or job.nodes,
            **({"queue": job.queue} if job.queue else {}),
            **({"priorityClass": job.priority_class} if job.priority_class else {}),
        }
    spec: dict[str, Any] = {"nprocPerNode": str(job.procs), "runPolicy": run_policy}
    replicas = {"Master": _replica(job, name, "Master", 1)}
    if job.nodes > 1 and job.fault_tolerance is None:
        # What the operator turns into PET_RDZV_ENDPOINT, PET_NNODES, PET_RDZV_ID, PET_MAX_RESTARTS:
        # the same values as the command line. Replica counts include the Master.
        etcd = job.etcd()
        spec["elasticPolicy"] = {
            "rdzvBackend": ETCD_BACKEND if etcd else "c10d",
            "rdzvHost": etcd[0] if etcd else f"{name}-master-0",
            "rdzvPort": etcd[1] if etcd else job.rdzv_port,
            "rdzvId": name,
            "minReplicas": job.min_nodes or job.nodes,
            "maxReplicas": job.nodes,
            "maxRestarts": job.max_restarts,
        }
    if job.nodes > 1:
        replicas["Worker"] = _replica(job, name, "Worker", job.nodes - 1)
    spec["pytorchReplicaSpecs"] = replicas
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata, "spec": spec}


def _volumes(pj: dict[str, Any]) -> list[dict[str, Any]]:
    """The Master pod's volumes (every replica mounts the same)."""
    return list(pj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"])


def render_manifest(cfg: Config, job: K8sJob) -> str:
    """Two YAML documents: the ConfigMap holding the frozen config, and the PyTorchJob."""
    pj = pytorch_job(cfg, job)
    meta = {k: v for k, v in pj["metadata"].items() if k != "labels"}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{meta['name']}-config"},
        "data": {"config.yaml": cfg.to_yaml()},
    }
    lighthouse = lighthouse_objects(job.image, job.priority_class, meta) if job.fault_tolerance else []
    claim = next(v["persistentVolumeClaim"]["claimName"] for v in _volumes(pj) if "persistentVolumeClaim" in v)
    header = (
        f"# Generated by `ddptrain k8s` for run {cfg.run.name} (Kubeflow Training Operator {OPERATOR_VERSION} "
        "PyTorchJob). Apply with: kubectl apply -f THIS_FILE\n"
        f"# Needs the PersistentVolumeClaim {claim} (ReadWriteMany; mounted at {job.shared_mount}, the working "
        "directory, holding run.dir and data.dir), not created here: create it once (docs/clusters.md shows one); "
        "deleting this job never deletes it, or the checkpoints on it.\n"
    )
    return header + yaml.dump_all([config_map, *lighthouse, pj], Dumper=_Dumper, sort_keys=False, width=1000)
