"""The PyTorchJob's replicas, run as real processes: what the operator and kubelet would start.

Each pod is one process started from the manifest alone, on its own network-namespace host
(tests/cluster/netns.py: own IP, own hostname) where namespaces can be made, else on loopback:
its command after Kubernetes' `$(VAR)` expansion from the container's env, `status.podIP` from the
downward API, the working directory on the "PVC" (a shared folder), the ConfigMap's config.yaml at
its mount path, and the Master's Service name resolvable through a private /etc/hosts
(bind-mounted in a mount namespace, as the kubelet manages /etc/hosts in a pod).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import TINY, env_for_subprocess, read_metrics, run_ddptrain
from netns import Cluster, Node, unavailable_reason

pytestmark = pytest.mark.cluster

LOOPBACK = "127.0.0.1"


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' rule for command/args: $(VAR) from the container env, $$ escapes, unknown stays."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def _container_env(container: dict[str, Any], pod_ip: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container["env"]:
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


@pytest.mark.timeout(240)
def test_manifest_replicas_train_to_the_end(corpus_dir: Path, tmp_path: Path, pod_hosts: list[Node] | None) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /etc/hosts per pod")
    pvc, config_mount = tmp_path / "pvc", tmp_path / "configmap"
    pvc.mkdir()
    gen = run_ddptrain(["k8s", *TINY, f"data.dir={corpus_dir}", "run.dir=runs/k8s", "--image", "local",
                        "--name", "ddp-k8s-test", "--nodes", "2", "--nproc-per-node", "1",
                        "--shared-mount", str(pvc), "--config-mount", str(config_mount),
                        "--rdzv-port", str(_free_port())], cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr
    config_map, job = yaml.safe_load_all(gen.stdout)
    config_mount.mkdir()
    for key, text in config_map["data"].items():
        (config_mount / key).write_text(text)
    pods = [(role, index, spec["template"]["spec"]["containers"][0])
            for role, spec in job["spec"]["pytorchReplicaSpecs"].items() for index in range(spec["replicas"])]
    pod_ips = [h.addr for h in pod_hosts] if pod_hosts else [LOOPBACK] * len(pods)
    hosts = tmp_path / "hosts"  # the kubelet-managed /etc/hosts plus the Master Service's DNS name
    hosts.write_text(f"127.0.0.1 localhost\n{pod_ips[0]} {job['metadata']['name']}-master-0\n")

    procs = []
    for (role, index, container), pod_ip in zip(pods, pod_ips):
        pod_env = _container_env(container, pod_ip)
        argv = [_expand(a, pod_env) for a in container["command"]]
        env = env_for_subprocess(pod_env)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])  # the image's ddptrain
        cmd = ["unshare", "--mount", "sh", "-c", f'mount --bind {hosts} /etc/hosts && cd "$0" && exec "$@"',
               container["workingDir"], *argv]
        name, log = f"{role}-{index}", tmp_path / f"{role}-{index}.log"
        if pod_hosts:
            procs.append((name, log, pod_hosts[len(procs)].start(cmd, env, log)))
        else:
            with open(log, "wb") as out:
                procs.append((name, log, subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)))
    try:
        codes = {name: proc.wait(timeout=200) for name, _, proc in procs}
    finally:
        for _, _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    logs = "\n".join(f"--- {name}\n{log.read_text(errors='replace')}" for name, log, _ in procs)
    assert codes == {"Master-0": 0, "Worker-0": 0}, logs
    train = read_metrics(pvc / "runs" / "k8s")
    assert train[-1]["step"] == 6 and train[-1]["world_size"] == 2, logs
    if pod_hosts:  # rank 0 ran on one of the namespace hosts, under its hostname
        assert read_metrics(pvc / "runs" / "k8s", "event")[0]["host"] in {h.hostname for h in pod_hosts}
    assert (pvc / "runs" / "k8s" / "checkpoints" / "step-00000006" / "manifest.json").is_file()
