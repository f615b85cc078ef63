"""The PyTorchJob's replicas, run as real processes: what the operator and kubelet would start.

Each pod is one process started from the manifest, on its own network-namespace host
(tests/cluster/netns.py: own IP, own hostname) where namespaces can be made, else on loopback:
its env is the manifest's own followed by exactly what the Kubeflow Training Operator v1.9.0
appends to each replica (tests/kubeflow_operator.py; the later duplicate wins, as in the kubelet),
its command after Kubernetes' `$(VAR)` expansion from that env, `status.podIP` from the
downward API, the working directory on the "PVC" (a shared folder), the ConfigMap's config.yaml at
its mount path, and the Master's Service name resolvable through a private /etc/hosts
(bind-mounted in a mount namespace, as the kubelet manages /etc/hosts in a pod).

Eviction (a node drain) is SIGTERM to one container's PID 1, here `ddptrain launch` itself: every
pod must commit and exit with the preempted code (the time it took is reported beside the manifest's
grace period, never asserted: a loaded machine would fail it), the
operator's rule for `restartPolicy: ExitCode` must say "recreate" for each, and the pods started
again must resume to the parameters of an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from etcd_harness import etcd_missing, start_etcd
from helpers import TINY, env_for_subprocess, final_model_state, read_metrics, run_ddptrain
from kubeflow_operator import injected_env, pod_restarted, with_defaults
from netns import Cluster, Node, unavailable_reason
from slurm_harness import report

pytestmark = pytest.mark.cluster

LOOPBACK = "127.0.0.1"


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' rule for command/args: $(VAR) from the container env, $$ escapes, unknown stays."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        arg,
    )


def _container_env(container: dict[str, Any], pod_ip: str, injected: list[tuple[str, str]]) -> dict[str, str]:
    """The container's environment: its own entries, then the operator's, later duplicates winning."""
    env: dict[str, str] = {}
    for item in [*container["env"], *({"name": k, "value": v} for k, v in injected)]:
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
        elif item["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP":
            env[item["name"]] = pod_ip
        else:
            raise AssertionError(f"unsupported env source {item}")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pod_hosts() -> Iterator[list[Node] | None]:
    """Two namespace hosts (one per pod, own IP and hostname) when the harness can run, else None."""
    if unavailable_reason() is not None:
        yield None
        return
    with Cluster(2) as hosts:
        yield hosts.nodes


@pytest.fixture
def pods(tmp_path: Path, pod_hosts: list[Node] | None) -> Pods:
    """The replica runner for this test (needs root for the per-pod /etc/hosts)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /etc/hosts per pod")
    return Pods(tmp_path, pod_hosts)


class Pods:
    """The manifest's replicas as processes: generate, start (again), wait."""

    def __init__(self, tmp_path: Path, hosts: list[Node] | None) -> None:
        self.tmp, self.hosts = tmp_path, hosts
        self.pvc, self.config_mount = tmp_path / "pvc", tmp_path / "configmap"
        self.pvc.mkdir()
        self.config_mount.mkdir()
        self.job: dict[str, Any] = {}
        self.procs: list[tuple[str, Path, subprocess.Popen[bytes]]] = []
        self.services: dict[str, str] = {}  # more Service names the pods resolve (name -> address)

    def generate(self, args: list[str]) -> None:
        """`ddptrain k8s ARGS` with the volumes at this test's folders; the ConfigMap materialised."""
        gen = run_ddptrain(
            [
                "k8s",
                *args,
                "--image",
                "local",
                "--name",
                "ddp-k8s-test",
                "--nodes",
                "2",
                "--nproc-per-node",
                "1",
                "--shared-mount",
                str(self.pvc),
                "--config-mount",
                str(self.config_mount),
                "--rdzv-port",
                str(_free_port()),
            ],
            cwd=self.tmp,
        )
        assert gen.returncode == 0, gen.stderr
        config_map, job = yaml.safe_load_all(gen.stdout)
        self.job = with_defaults(job)
        for key, text in config_map["data"].items():
            (self.config_mount / key).write_text(text)

    def start(self, attempt: int = 0) -> None:
        """One process per replica, as the kubelet would run the container."""
        replicas = [
            (role, index, spec["template"]["spec"]["containers"][0])
            for role, spec in self.job["spec"]["pytorchReplicaSpecs"].items()
            for index in range(spec["replicas"])
        ]
        pod_ips = [h.addr for h in self.hosts] if self.hosts else [LOOPBACK] * len(replicas)
        hosts = self.tmp / "hosts"  # the kubelet-managed /etc/hosts plus the Master Service's DNS name
        services = {f"{self.job['metadata']['name']}-master-0": pod_ips[0], **self.services}
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in services.items()))
        self.procs = []
        for i, ((role, index, container), pod_ip) in enumerate(zip(replicas, pod_ips)):
            pod_env = _container_env(container, pod_ip, injected_env(self.job, role, index))
            argv = [_expand(a, pod_env) for a in container["command"]]
            env = env_for_subprocess(pod_env)
            env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])  # the image's ddptrain
            # Every wrapper execs, so the process is `ddptrain launch` itself, as PID 1 of a container is.
            cmd = [
                "unshare",
                "--mount",
                "sh",
                "-c",
                f'mount --bind {hosts} /etc/hosts && cd "$0" && exec "$@"',
                container["workingDir"],
                *argv,
            ]
            name, log = f"{role}-{index}", self.tmp / f"{role}-{index}-{attempt}.log"
            if self.hosts:
                self.procs.append((name, log, self.hosts[i].start(cmd, env, log)))
            else:
                with open(log, "wb") as out:
                    self.procs.append((name, log, subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)))

    def wait(self, timeout: float = 200) -> tuple[dict[str, int], str]:
        """Exit code per pod, and all their logs."""
        try:
            codes = {name: proc.wait(timeout=timeout) for name, _, proc in self.procs}
        finally:
            for _, _, proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
        return codes, "\n".join(f"--- {name}\n{log.read_text(errors='replace')}" for name, log, _ in self.procs)

    @property
    def run_dir(self) -> Path:
        return self.pvc / "runs" / "k8s"


@pytest.mark.timeout(240)
def test_manifest_replicas_train_to_the_end(pods: Pods, corpus_dir: Path) -> None:
    pods.generate([*TINY, f"data.dir={corpus_dir}", "run.dir=runs/k8s"])
    pods.start()
    codes, logs = pods.wait()
    assert codes == {"Master-0": 0, "Worker-0": 0}, logs
    assert "differs from" not in logs  # the operator's variables agree with the command line
    train = read_metrics(pods.run_dir)
    assert train[-1]["step"] == 6 and train[-1]["world_size"] == 2, logs
    if pods.hosts:  # rank 0 ran on one of the namespace hosts, under its hostname
        assert read_metrics(pods.run_dir, "event")[0]["host"] in {h.hostname for h in pods.hosts}
    assert (pods.run_dir / "checkpoints" / "step-00000006" / "manifest.json").is_file()


@pytest.mark.timeout(120)
def test_manifest_with_etcd_service_trains_through_etcd(pods: Pods, corpus_dir: Path, tmp_path: Path) -> None:
    """--etcd-service: both pods meet in a real etcd reached by its Service name, as the operator announces."""
    if etcd_missing() or pods.hosts is None:
        pytest.skip(etcd_missing() or "needs namespace hosts (etcd listens on a pod host's address)")
    etcd_host = pods.hosts[0]  # etcd beside the first pod: what matters here is the manifest's wiring
    start_etcd([etcd_host], tmp_path)
    pods.services["etcd-client.etcd"] = etcd_host.addr
    pods.generate([*TINY, f"data.dir={corpus_dir}", "run.dir=runs/k8s", "--etcd-service", "etcd-client.etcd"])
    pods.start()
    codes, logs = pods.wait(100)
    assert codes == {"Master-0": 0, "Worker-0": 0}, logs
    assert "differs from" not in logs  # PET_RDZV_ENDPOINT (the Service) agrees with the command line
    assert read_metrics(pods.run_dir)[-1]["world_size"] == 2, logs


@pytest.mark.timeout(300)
def test_evicted_pods_commit_exit_preempted_and_resume(
    pods: Pods, corpus_dir: Path, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    steps = 300
    config = [*TINY, f"train.max_steps={steps}", "ckpt.every_steps=0", f"data.dir={corpus_dir}"]
    reference = run_ddptrain(["train", *config, f"run.dir={tmp_path / 'reference'}"], nproc=2, timeout=200)
    assert reference.returncode == 0, reference.stderr
    pods.generate([*config, "run.dir=runs/k8s", "--step-seconds", "5", "--save-seconds", "10"])
    grace = pods.job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pods.start()
    deadline = time.monotonic() + 120
    while not (pods.run_dir / "metrics.jsonl").is_file() or not read_metrics(pods.run_dir):
        assert time.monotonic() < deadline and all(p.poll() is None for _, _, p in pods.procs), pods.wait(1)[1]
        time.sleep(0.05)
    evicted = time.monotonic()
    evicted_pod, _, proc = pods.procs[-1]  # a node drain evicts one pod: SIGTERM to its container's PID 1
    proc.send_signal(signal.SIGTERM)
    # The grace period is a promise about time, which a loaded CI machine cannot keep honestly: the test
    # asserts the behaviour (both pods commit the same step and exit 143) and reports the time against it.
    codes, logs = pods.wait(timeout=max(grace, 120))
    stopped_s = time.monotonic() - evicted
    command = pods.job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    preempted_code = int(command[command.index("--preempted-exit-code") + 1])
    assert preempted_code == 143 and codes == {"Master-0": 143, "Worker-0": 143}, logs
    assert all(
        pod_restarted(pods.job["spec"]["pytorchReplicaSpecs"][n.split("-")[0]]["restartPolicy"], c)
        for n, c in codes.items()
    )  # the operator recreates them all; nothing counts against a budget
    assert "differs from" not in logs
    pods.start(attempt=1)
    codes, logs = pods.wait()
    assert codes == {"Master-0": 0, "Worker-0": 0}, logs
    events = read_metrics(pods.run_dir, "event")
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    (resumed,) = [e for e in events if e["event"] == "resume"]
    assert resumed["step"] == preempted["step"] < steps
    final, expected = final_model_state(pods.run_dir), final_model_state(tmp_path / "reference")
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=0, msg=f"parameter {name} differs")
    report(
        pytestconfig,
        f"k8s eviction: SIGTERM to {evicted_pod} -> both pods committed and exited 143 "
        f"in {stopped_s:.1f} s "
        f"(terminationGracePeriodSeconds {grace}), checkpoint at step {preempted['step']}",
    )
