"""The Lighthouse of a PyTorchJob in the in-place mode (`ddptrain k8s --fault-tolerance torchft`).

A Deployment of one pod serves it on the pod's IP; a Service `<job>-lighthouse` gives it the one
address every replica group looks for. Losing it pauses every group (they keep their state); the
Deployment recreates the pod, the Service's address stays, and the groups go on at their next
quorum. `strategy: Recreate` keeps two Lighthouses from ever serving the job at once (each would
form quorums of its own).
"""

from __future__ import annotations

from typing import Any

LIGHTHOUSE_PORT = 29510
LIGHTHOUSE_CPU, LIGHTHOUSE_MEMORY = "1", "1Gi"  # a small server: quorums and heartbeats, no tensors


def lighthouse_objects(image: str, priority_class: str | None, metadata: dict[str, Any]) -> list[dict[str, Any]]:
    """The Deployment and the Service of the job's Lighthouse (metadata: the job's name and namespace)."""
    name = f"{metadata['name']}-lighthouse"
    labels = {"app.kubernetes.io/name": "ddptrain-lighthouse", "app.kubernetes.io/instance": metadata["name"]}
    meta = {**metadata, "name": name, "labels": labels}
    amounts = {"cpu": LIGHTHOUSE_CPU, "memory": LIGHTHOUSE_MEMORY}
    container = {
        "name": "lighthouse",
        "image": image,
        # Its own address, never all interfaces: anyone reaching it could join or stall the job.
        "command": ["ddptrain", "lighthouse", "--bind", f"$(POD_IP):{LIGHTHOUSE_PORT}"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT}],
        "readinessProbe": {"tcpSocket": {"port": LIGHTHOUSE_PORT}, "periodSeconds": 2},
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
    }
    pod: dict[str, Any] = {"containers": [container]}
    if priority_class:
        pod["priorityClassName"] = priority_class  # evicted no sooner than the groups it serves
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "selector": labels,
            "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT, "targetPort": LIGHTHOUSE_PORT}],
        },
    }
    return [deployment, service]
