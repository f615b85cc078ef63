"""The jobs of the goodput benchmark: one training job on namespace hosts, in either fault-tolerance mode.

Hosts are network namespaces on a bridge (tests/cluster/netns.py: needs root), one rank per host, all
writing one run folder (a shared filesystem). `RestartJob` is today's mode: `ddptrain launch --nnodes
MIN:MAX` per host (torchrun's elastic agent), a killed worker makes every agent stop and restart its
workers, which resume from the last checkpoint. `InPlaceJob` is the in-place mode as
tests/cluster/test_in_place_recovery.py runs it: a Lighthouse on the first host and one plain `ddptrain
train` process per host as its replica group; the job restarts a killed group as soon as it is reaped,
and a group that exits on its own, as `ddptrain launch --fault-tolerance torchft --max-restarts` does for
its own group.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO

sys.path.insert(0, str(REPO / "tests" / "cluster"))  # the test suite's namespace hosts
from netns import Cluster, Node  # noqa: E402

RENDEZVOUS_PORT = 29400
LIGHTHOUSE_PORT = 29510
# The restart mode's launcher, as tests/cluster/test_multinode_faults.py runs it: short rendezvous
# timeouts and keep-alives, so that a restart is not padded by waits meant for slow clusters.
LAUNCH = [
    "--nproc-per-node",
    "1",
    "--max-restarts",
    "1000",
    "--rdzv-timeout",
    "30",
    "--rdzv-last-call",
    "1",
    "--shutdown-timeout",
    "15",
    "--exit-barrier-timeout",
    "30",
    "--rdzv-conf",
    "keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=10",
]


@dataclass(frozen=True)
class Kill:
    """One fault: which host, when (time.time()), and when its replacement was started (in place only)."""

    host: int
    time: float
    restarted: float | None = None


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A worker's environment: this checkout's sources first, one thread, no inherited torchrun state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]))
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})})
    return env


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a line cut off by a kill is skipped."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class Job:
    """A job on `hosts` namespace hosts writing `folder/run`; close() kills everything and removes the hosts."""

    mode = ""

    def __init__(self, folder: Path, hosts: int, train: list[str]) -> None:
        self.folder = folder
        self.run_dir = folder / "run"
        self.train = [*train, f"run.dir={self.run_dir}"]
        self.cluster = Cluster(hosts)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def log(self, host: int) -> Path:
        """Where the host's process writes its output."""
        return self.folder / f"{self.mode}-host{host}.log"

    def records(self) -> list[dict[str, Any]]:
        """metrics.jsonl as written so far."""
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def first_step_time(self, timeout: float) -> float:
        """Wait for the first committed step; its record's time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            train = [r for r in self.records() if r["kind"] == "train"]
            if train:
                return float(train[0]["time"])
            if all(p.poll() is not None for p in self.procs.values()):
                break
            time.sleep(0.1)
        tails = "\n".join(self.log(h).read_text()[-2000:] for h in self.procs if self.log(h).exists())
        raise RuntimeError(f"{self.mode}: no step within {timeout:.0f} s\n{tails}")

    def start(self) -> None:
        """Start the job on every host."""
        raise NotImplementedError

    def kill(self, rng: random.Random) -> Kill | None:
        """SIGKILL the training process of a random host (None when no host has one right now)."""
        raise NotImplementedError

    def revive(self) -> list[int]:
        """Restart what died on its own; the hosts restarted (the restart mode's agents do it themselves)."""
        return []

    def close(self) -> None:
        """Kill every process on every host and remove the hosts."""
        self.cluster.close()


class RestartJob(Job):
    """Today's mode: `ddptrain launch --nnodes MIN:MAX` on every host; a kill restarts every worker."""

    mode = "restart"

    def __init__(self, folder: Path, hosts: int, train: list[str], min_hosts: int) -> None:
        super().__init__(folder, hosts, train)
        self.nnodes = f"{min_hosts}:{hosts}"

    def start(self) -> None:
        """One elastic agent per host, the rendezvous on the first host."""
        endpoint = f"{self.cluster.nodes[0].addr}:{RENDEZVOUS_PORT}"
        for node in self.cluster.nodes:
            argv = [sys.executable, "-m", "ddptrain", "launch", "--nnodes", self.nnodes, "--rdzv-endpoint", endpoint]
            argv += ["--node-addr", node.addr, *LAUNCH, "--", "train", *self.train]
            self.procs[node.index] = node.start(argv, child_env(), self.log(node.index))

    def workers(self, node: Node) -> list[int]:
        """The host's worker pids: every process in it but its agent and the agent's multiprocessing helpers."""
        agent = self.procs[node.index].pid
        return [p for p in node.pids() if p != agent and not _agent_helper(p, agent)]

    def kill(self, rng: random.Random) -> Kill | None:
        """SIGKILL the worker of a random host that has one (between restarts a host may have none)."""
        candidates = [(n, self.workers(n)) for n in self.cluster.nodes]
        candidates = [(n, pids) for n, pids in candidates if pids]
        if not candidates:
            return None
        node, pids = rng.choice(candidates)
        killed_at = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return Kill(node.index, killed_at)


def _agent_helper(pid: int, agent: int) -> bool:
    """A multiprocessing helper of the agent (its fork server, resource tracker): not a worker."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        own = Path(f"/proc/{agent}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False
    # the resource tracker is exec'd ("multiprocessing." in its command line); the fork server is a fork of the
    # agent itself (launch/worker_start.py), its command line the agent's
    return ppid == agent and (b"multiprocessing." in cmdline or cmdline == own)


class InPlaceJob(Job):
    """The in-place mode: a Lighthouse and one replica group per host; a killed group is restarted and heals."""

    mode = "in-place"

    def start(self) -> None:
        """The Lighthouse on the first host (ddptrain's defaults), then one group per host."""
        node = self.cluster.nodes[0]
        self.lighthouse = f"{node.addr}:{LIGHTHOUSE_PORT}"
        argv = [sys.executable, "-m", "ddptrain", "lighthouse", "--bind", self.lighthouse]
        node.start(argv, child_env(), self.folder / "lighthouse.log")
        time.sleep(1.0)
        for n in self.cluster.nodes:
            self.start_group(n.index)

    def start_group(self, group: int) -> float:
        """Start the replica group of host `group`; when it was started."""
        node = self.cluster.nodes[group]
        env = child_env(
            {
                "DDPTRAIN_REPLICA_GROUP": str(group),
                "TORCHFT_LIGHTHOUSE": f"http://{self.lighthouse}",
                "DDPTRAIN_BIND_ADDR": node.addr,
                "GLOO_SOCKET_IFNAME": node.dev,
            }
        )
        started = time.time()
        self.procs[group] = node.start([sys.executable, "-m", "ddptrain", "train", *self.train], env, self.log(group))
        return started

    def revive(self) -> list[int]:
        """Start again every group that exited on its own (as the launcher's --max-restarts would)."""
        dead = [g for g, p in self.procs.items() if p.poll() is not None]
        for group in dead:
            self.start_group(group)
        return dead

    def kill(self, rng: random.Random) -> Kill | None:
        """SIGKILL a random running group, reap it, start its replacement at once (a launcher's restart)."""
        running = [g for g, p in self.procs.items() if p.poll() is None]
        if not running:
            return None
        group = rng.choice(running)
        proc = self.procs[group]
        killed_at = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        return Kill(group, killed_at, self.start_group(group))
