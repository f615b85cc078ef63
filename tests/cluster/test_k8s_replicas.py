"""The PyTorchJob's replicas, run as real processes: what the operator and kubelet would start.

Each pod is one process started from the manifest alone: its command with Kubernetes' `$(VAR)`
expansion from the container's env, `status.podIP` from the downward API, the working directory
on the "PVC" (a shared folder), the ConfigMap's config.yaml materialised at its mount path, and
the master's Service name resolvable (a private /etc/hosts bind-mounted in a mount namespace,
as the kubelet manages /etc/hosts in a pod).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import TINY, env_for_subprocess, read_metrics, run_ddptrain

pytestmark = pytest.mark.cluster

POD_IP = "127.0.0.1"


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' rule for command/args: $(VAR) from the container env, $$ escapes, unknown stays."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
        elif item["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP":
            env[item["name"]] = POD_IP
        else:
            raise AssertionError(f"unsupported env source {item}")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_manifest_replicas_train_to_the_end(corpus_dir: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /etc/hosts per pod")
    if importlib.util.find_spec("ddptrain.launch") is None:
        pytest.skip("`ddptrain launch` (ddptrain/launch.py, issue 4) is not on this branch: every pod runs it")
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
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{POD_IP} {job['metadata']['name']}-master-0\n")

    procs = []
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        (container,) = spec["template"]["spec"]["containers"]
        for index in range(spec["replicas"]):
            pod_env = _container_env(container)
            argv = [_expand(a, pod_env) for a in container["command"]]
            env = env_for_subprocess(pod_env)
            env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])  # the image's ddptrain
            log = open(tmp_path / f"{role}-{index}.log", "w")
            procs.append((f"{role}-{index}", log, subprocess.Popen(
                ["unshare", "--mount", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "pod", *argv],
                cwd=container["workingDir"], env=env, stdout=log, stderr=subprocess.STDOUT,
            )))
    try:
        codes = {name: proc.wait(timeout=200) for name, _, proc in procs}
    finally:
        for _, log, proc in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = "\n".join(f"--- {name}\n{(tmp_path / f'{name}.log').read_text()}" for name, _, _ in procs)
    assert codes == {"Master-0": 0, "Worker-0": 0}, logs
    train = read_metrics(pvc / "runs" / "k8s")
    assert train[-1]["step"] == 6 and train[-1]["world_size"] == 2, logs
    assert (pvc / "runs" / "k8s" / "checkpoints" / "step-00000006" / "manifest.json").is_file()
