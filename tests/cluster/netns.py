"""Several "hosts" on one Linux machine: network namespaces on a bridge (needs root and `ip netns`).

Each Node is a namespace with its own veth, IPv4 address (10.77.<random>.<i+1>/24) and, for the
processes started in it, its own hostname (a UTS namespace). All names carry a random tag, so
tests never collide; close() kills every process in every namespace and removes the namespaces
and the bridge. Faults: kill processes, take the link down, rate-limit it with tc tbf.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

try:  # the tests' zygote (tests/zygote.py); bench/ft_jobs.py uses these hosts without it (tests/ not on its path)
    from helpers import start_ddptrain, use_zygote
except ImportError:
    start_ddptrain = None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "multi-host tests need root (Linux network namespaces)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"multi-host tests need the `{tool}` command"
    probe = f"ddpt-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Node:
    """One host: a namespace with an address on the cluster's bridge."""

    def __init__(self, cluster: Cluster, index: int) -> None:
        tag = cluster.tag
        self.index = index
        self.hostname = f"node{index + 1}"
        self.ns = f"ddpt-{tag}-{index + 1}"
        self.dev = f"ddv{tag}{index + 1}"  # inside the namespace
        self.peer = f"ddp{tag}{index + 1}"  # on the bridge
        self.addr = f"10.77.{cluster.subnet}.{index + 1}"
        self.procs: list[Any] = []  # subprocess.Popen, or the zygote's process with the same interface
        self._logs: list[IO[bytes]] = []

    def setup(self, bridge: str) -> None:
        """Create the namespace and plug it into the bridge."""
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.dev, "type", "veth", "peer", "name", self.peer)
        _ip("link", "set", self.dev, "netns", self.ns)
        _ip("link", "set", self.peer, "master", bridge)
        _ip("link", "set", self.peer, "up")
        self.exec("ip", "addr", "add", f"{self.addr}/24", "dev", self.dev)
        self.exec("ip", "link", "set", self.dev, "up")
        self.exec("ip", "link", "set", "lo", "up")

    def exec(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """Run a short command in the namespace (checked)."""
        return _ip("netns", "exec", self.ns, *cmd)

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> Any:
        """Start a process in the namespace under this node's own hostname; output goes to `log`. A
        `python -m ddptrain` command is forked from the test zygote (tests/zygote.py), which enters the
        namespace itself: a subprocess.Popen or the zygote's process with the same interface."""
        out = open(log, "ab")
        self._logs.append(out)
        if start_ddptrain is not None and argv[:3] == [sys.executable, "-m", "ddptrain"] and use_zygote():
            proc = start_ddptrain(
                argv[3:],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                netns=self.ns,
                hostname=self.hostname,
            )
            self.procs.append(proc)
            return proc
        cmd = [
            "ip",
            "netns",
            "exec",
            self.ns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {self.hostname} && exec "$@"',
            "sh",
            *argv,
        ]
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process in the namespace."""
        out = _ip("netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split()]

    def signal_all(self, sig: signal.Signals) -> None:
        """Send a signal to every process in the namespace."""
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        """SIGKILL every process in the namespace and reap the ones started here."""
        for _ in range(3):
            self.signal_all(signal.SIGKILL)
            time.sleep(0.1)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def link(self, up: bool) -> None:
        """Connect or disconnect this node from the bridge (like pulling the cable)."""
        _ip("link", "set", self.peer, "up" if up else "down")

    def rate_limit(self, rate: str) -> None:
        """Limit this node's outgoing traffic with a token bucket (tc tbf)."""
        self.exec(
            "tc", "qdisc", "add", "dev", self.dev, "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"
        )

    def close(self) -> None:
        """Kill everything in the namespace and remove it (its veth goes with it)."""
        self.kill_all()
        for log in self._logs:
            log.close()
        _ip("netns", "del", self.ns, check=False)
        _ip("link", "del", self.peer, check=False)  # gone with the namespace unless setup failed halfway


class Cluster:
    """n nodes on one bridge; use as a context manager or call close()."""

    def __init__(self, n: int) -> None:
        self.tag = secrets.token_hex(3)[:5]
        # Subnets modulo the pytest-xdist worker count by worker: two workers' clusters never share one (a SLURM
        # test puts the bridge itself on its subnet, in the machine's own namespace).
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        self.subnet = (int(self.tag, 16) % (250 // workers)) * workers + (int(worker) if worker.isdigit() else 0) + 1
        self.bridge = f"ddb{self.tag}"
        self.nodes: list[Node] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("link", "set", self.bridge, "up")
            for i in range(n):
                self.nodes.append(Node(self, i))
                self.nodes[-1].setup(self.bridge)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove every namespace and the bridge, killing all their processes."""
        for node in self.nodes:
            node.close()
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hosts_or_skip(n: int) -> Iterator[Cluster]:
    """n fresh hosts for a test fixture, removed afterwards pass or fail; the test is skipped, with the reason,
    where namespaces cannot be made."""
    import pytest  # only the tests' fixtures skip (bench/ft_jobs.py uses these hosts too)

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with Cluster(n) as cluster:
        yield cluster
