"""etcd members on namespace hosts (tests/cluster/netns.py), from Debian's `etcd-server` package.

Each member runs on its own Node with the v2 API on (torch's etcd rendezvous speaks v2), its data
in a temp folder, and short heartbeat and election timeouts so that losing a member is settled in
about a second. `start_etcd` returns once every member says it is healthy, or fails the test.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from helpers import env_for_subprocess
from netns import Node

from ddptrain.launch.etcd_endpoints import health

CLIENT_PORT, PEER_PORT = 2379, 2380


def etcd_missing() -> str | None:
    """Why etcd tests cannot run here (no server binary, no client library), or None."""
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        return "needs Debian's etcd-server and etcd-client (etcd, etcdctl; .ci/install-etcd installs them)"
    try:
        import etcd  # noqa: F401
    except ImportError:
        return "needs PyPI's python-etcd (the etcd extra)"
    return None


def client_url(node: Node) -> str:
    """http://ADDR:2379 of the member on `node`."""
    return f"http://{node.addr}:{CLIENT_PORT}"


def endpoints(nodes: Sequence[Node]) -> str:
    """The members as `ddptrain launch --rdzv-endpoint` takes them."""
    return ",".join(f"{n.addr}:{CLIENT_PORT}" for n in nodes)


def _healthy(node: Node, members: Sequence[Node]) -> bool:
    urls = ",".join(client_url(m) for m in members)
    done = subprocess.run(
        ["ip", "netns", "exec", node.ns, "etcdctl", "--endpoints", urls, "--command-timeout=1s", "endpoint", "health"],
        capture_output=True,
        text=True,
        timeout=10,
        env={**env_for_subprocess(), "ETCDCTL_API": "3"},
    )
    return done.returncode == 0


def start_etcd(members: Sequence[Node], tmp: Path, timeout: float = 20) -> None:
    """Start one etcd member per node as one cluster and wait until all are healthy."""
    cluster = ",".join(f"{n.hostname}=http://{n.addr}:{PEER_PORT}" for n in members)
    for node in members:
        argv = [
            "etcd",
            "--name",
            node.hostname,
            "--data-dir",
            str(tmp / f"etcd-{node.hostname}"),
            "--enable-v2",
            "--listen-client-urls",
            client_url(node),
            "--advertise-client-urls",
            client_url(node),
            "--listen-peer-urls",
            f"http://{node.addr}:{PEER_PORT}",
            "--initial-advertise-peer-urls",
            f"http://{node.addr}:{PEER_PORT}",
            "--initial-cluster",
            cluster,
            "--initial-cluster-token",
            f"token-{members[0].ns}",  # the same for every member of one cluster
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval",
            "100",
            "--election-timeout",
            "1000",
        ]
        node.start(argv, env_for_subprocess(), tmp / f"etcd-{node.hostname}.log")
    deadline = time.monotonic() + timeout
    while not _healthy(members[0], members):
        if time.monotonic() > deadline:
            logs = "\n".join((tmp / f"etcd-{n.hostname}.log").read_text()[-1500:] for n in members)
            pytest.fail(f"etcd did not become healthy within {timeout} s\n{logs}")
        time.sleep(0.2)


def free_port() -> int:
    """A TCP port nothing listens on right now (on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def loopback_etcd(tmp: Path, v2: bool = True, timeout: float = 15) -> Iterator[str]:
    """One etcd member on 127.0.0.1 (v2 API on or off) for as long as the block runs; yields HOST:PORT."""
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    argv = ["etcd", "--data-dir", str(tmp / f"etcd-{client}"), "--listen-client-urls", url]
    argv += ["--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}"]
    with open(tmp / f"etcd-{client}.log", "wb") as log:
        proc = subprocess.Popen([*argv, *(["--enable-v2"] if v2 else [])], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while (why := health(("127.0.0.1", client), 1.0)) is not None and "v2 API is off" not in why:
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"etcd on {url} did not start\n{(tmp / f'etcd-{client}.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait(10)
