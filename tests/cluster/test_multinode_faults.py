"""Multi-node fault scenarios: `ddptrain launch` on two network namespaces ("hosts") on a bridge.

Every node runs one worker (2 CPU cores in CI) of a tiny regression model that sleeps a little in
each step, so faults land mid-training. Collective timeout 10 s, short rendezvous timeouts.
Final parameters are compared with an uninterrupted run (plain torchrun, same world size): resume
from checkpoints is bit-exact on CPU. Each test prints MEASURED lines (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cached_run, env_for_subprocess, final_model_state
from netns import Cluster, Node, unavailable_reason

from ddptrain.checkpoint import committed_checkpoints, verify_checkpoint
from ddptrain.errors import EXIT_PREEMPTED

pytestmark = pytest.mark.cluster

PORT = 29400
STEPS = 40
TOY = [
    "model.target=faulty:build_model",
    "data.target=toy:build_datasets",
    "data.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "log.every_steps=1",
    "ckpt.every_steps=10",
    "dist.timeout_s=10",
    "dist.startup_timeout_s=90",
    f"train.max_steps={STEPS}",
]
SLOW = "model.kwargs.step_sleep=0.15"  # ~6 s of training: time to inject a fault mid-run
LAUNCH = [
    "--nproc-per-node",
    "1",
    "--max-restarts",
    "3",
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


@pytest.fixture(scope="module")
def namespaces_ok() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def cluster(namespaces_ok: None) -> Iterator[Cluster]:
    """Two fresh hosts; everything in them is killed and removed afterwards, pass or fail."""
    c = Cluster(2)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def reference(reference_cache: Path) -> Callable[..., dict[str, torch.Tensor]]:
    """Final parameters of an uninterrupted 2-rank run, trained once per session per config
    (helpers.cached_run: the pytest workers share it)."""

    def get(*extra: str) -> dict[str, torch.Tensor]:
        return final_model_state(cached_run(reference_cache, ["train", *TOY, *extra, "run.dir={out}"], nproc=2))

    return get


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs from the uninterrupted run"


class Job:
    """`ddptrain launch` on each node of a cluster, all writing one run dir (a shared filesystem)."""

    def __init__(
        self,
        cluster: Cluster,
        tmp: Path,
        nnodes: str = "2",
        launch: list[str] | None = None,
        train: list[str] | None = None,
    ) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.run_dir = tmp / "run"
        self.host = cluster.nodes[0]
        self.nnodes = nnodes
        self.launch_opts = [*LAUNCH, *(launch or [])]
        self.train_args = [*TOY, *(train or []), f"run.dir={self.run_dir}"]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def argv(self, node: Node) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ddptrain",
            "launch",
            "--nnodes",
            self.nnodes,
            "--rdzv-endpoint",
            f"{self.host.addr}:{PORT}",
            "--node-addr",
            node.addr,
            *self.launch_opts,
            "--",
            "train",
            *self.train_args,
        ]

    def start(self, *nodes: Node) -> None:
        for node in nodes or tuple(self.cluster.nodes):
            env = env_for_subprocess({"LOGLEVEL": "INFO"})  # the agents say what they do, in the node logs
            self.procs[node.hostname] = node.start(self.argv(node), env, self.log(node))

    def log(self, node: Node) -> Path:
        return self.tmp / f"{node.hostname}.log"

    def output(self) -> str:
        return "\n".join(
            f"--- {n.hostname}\n{self.log(n).read_text()[-4000:]}" for n in self.cluster.nodes if self.log(n).exists()
        )

    def wait(self, timeout: float, *nodes: Node) -> dict[str, int]:
        """Exit codes of the launchers, waiting at most `timeout` seconds for all of them."""
        deadline = time.monotonic() + timeout
        codes = {}
        for node in nodes or tuple(self.cluster.nodes):
            try:
                codes[node.hostname] = self.procs[node.hostname].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{node.hostname} did not exit within {timeout} s\n{self.output()}")
        return codes

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r["kind"] == kind]

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            if all(p.poll() is not None for p in self.procs.values()):
                break
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {what}\n{self.output()}")

    def wait_for_step(self, step: int, timeout: float = 120) -> float:
        """Wait until training reached `step`; returns the time it was logged."""
        rec = self.wait_for(f"step {step}", lambda: [r for r in self.records("train") if r["step"] >= step], timeout)
        return rec[0]["time"]

    def training_again_after(self, t: float, timeout: float = 120, world_size: int | None = None) -> float:
        """Seconds from t until a train record from a resumed group (optionally at world_size)."""

        def resumed() -> list[dict[str, Any]]:
            events = [
                r
                for r in self.events("resume")
                if r["time"] > t and (world_size is None or r["world_size"] == world_size)
            ]
            if not events:
                return []
            return [r for r in self.records("train") if r["time"] > events[0]["time"]]

        return self.wait_for("training to resume", resumed, timeout)[0]["time"] - t

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records("event") if r["event"] == name]

    def workers(self, node: Node) -> list[int]:
        """The worker pids on a node: every process in it but the launcher and its multiprocessing
        helpers (the preloaded fork server the workers are forked from, the resource tracker)."""
        launcher = self.procs[node.hostname].pid
        return [p for p in node.pids() if p != launcher and not _launcher_helper(p, launcher)]


def _launcher_helper(pid: int, launcher: int) -> bool:
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        own = Path(f"/proc/{launcher}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False
    # the resource tracker is exec'd ("multiprocessing." in its command line); the fork server is a fork of the
    # launcher itself (launch/worker_start.py), its command line the launcher's
    return ppid == launcher and (b"multiprocessing." in cmdline or cmdline == own)


def measured(scenario: str, **numbers: float) -> None:
    print(f"MEASURED {scenario}: " + ", ".join(f"{k} {v:.1f} s" for k, v in numbers.items()))


# ---- scenarios ------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_sigkill_one_worker_restarts_from_checkpoint(
    cluster: Cluster, tmp_path: Path, reference: Callable[..., Any]
) -> None:
    job = Job(cluster, tmp_path, train=[SLOW])
    job.start()
    job.wait_for_step(15)
    t_kill = time.time()
    for pid in job.workers(cluster.nodes[1]):
        os.kill(pid, signal.SIGKILL)
    recovery = job.training_again_after(t_kill)
    assert job.wait(150) == {"node1": 0, "node2": 0}, job.output()
    assert [(r["step"], r["world_size"]) for r in job.events("resume")] == [(10, 2)]
    assert_same_params(final_model_state(job.run_dir), reference())
    # The recovery timeline (rank 0's host saw the peer's failure): every phase, in order, adding up to its total
    # (the record's own arithmetic, whatever the machine's speed; how long it took is for make test-measure).
    (timeline,) = job.events("recovery")
    names = [name for name, _ in timeline["phases"]]
    assert timeline["since"] == "failure_seen", timeline
    assert names == ["stop", "rendezvous", "spawn", "exec", "import", "process group", "build+load", "first step"]
    assert all(seconds >= -0.02 for _, seconds in timeline["phases"]), timeline  # /proc start time: 10 ms ticks
    assert abs(sum(s for _, s in timeline["phases"]) - timeline["total_s"]) < 0.05, timeline
    assert timeline["total_s"] > 0, timeline
    measured("SIGKILL one worker", training_again=recovery, **{n.replace(" ", "_"): s for n, s in timeline["phases"]})


@pytest.mark.timeout(240)
def test_worker_raises_then_resumes(cluster: Cluster, tmp_path: Path, reference: Callable[..., Any]) -> None:
    job = Job(cluster, tmp_path, train=[SLOW, "model.kwargs.fail_at=15", "model.kwargs.fail_rank=1"])
    t0 = time.time()
    job.start()
    assert job.wait(200) == {"node1": 0, "node2": 0}, job.output()
    assert [(r["step"], r["world_size"]) for r in job.events("resume")] == [(10, 2)]
    assert_same_params(final_model_state(job.run_dir), reference())
    assert "injected failure at forward 15 on rank 1" in (job.run_dir / "stacks" / "rank-1-node2.txt").read_text()
    measured("worker raises at step 15", whole_job=time.time() - t0)


@pytest.mark.timeout(240)
def test_worker_raises_with_restarts_used_up_fails_with_the_cause(cluster: Cluster, tmp_path: Path) -> None:
    job = Job(
        cluster,
        tmp_path,
        launch=["--max-restarts", "1"],
        train=["model.kwargs.fail_at=3", "model.kwargs.fail_rank=1", "model.kwargs.fail_restarts=99"],
    )
    t0 = time.time()
    job.start()
    codes = job.wait(200)
    assert codes == {"node1": 1, "node2": 1}, job.output()
    node2 = job.log(cluster.nodes[1]).read_text()
    assert "job failed" in node2 and "injected failure at forward 3 on rank 1" in node2.split("job failed")[-1]
    # The other node names the rank that failed on its own, and where it runs.
    node1 = job.log(cluster.nodes[0]).read_text()
    assert "because rank 1 (node2) failed: RuntimeError: injected failure" in node1
    assert "Connection closed by peer" not in node1 and "Connection reset" not in node1
    measured("worker raises, restarts used up", whole_job=time.time() - t0)


@pytest.mark.timeout(300)
def test_node_lost_then_back_elastic(cluster: Cluster, tmp_path: Path) -> None:
    node1, node2 = cluster.nodes
    job = Job(cluster, tmp_path, nnodes="1:2", train=[SLOW, "train.max_steps=80"])
    job.start()
    job.wait_for_step(15)
    t_kill = time.time()
    node2.kill_all()
    alone = job.training_again_after(t_kill, world_size=1)
    resumed = job.events("resume")[-1]
    assert (resumed["world_size"], resumed["grad_accum"]) == (1, 2)  # the global batch of 8 is kept
    alone_rows = [r for r in job.records("train") if r["time"] > resumed["time"]]
    assert all(r["global_batch_size"] == 8 and r["world_size"] == 1 for r in alone_rows)
    t_back = time.time()
    job.start(node2)
    together = job.training_again_after(t_back, world_size=2)
    assert job.wait(200) == {"node1": 0, "node2": 0}, job.output()
    last = job.records("train")[-1]
    assert (last["step"], last["world_size"], last["grad_accum"]) == (80, 2, 1)
    # One recovery for the loss and one for the return; a busy machine may add one between (a rendezvous round
    # that a slow node missed), which the job rides out like the others.
    timelines = job.events("recovery")
    alone_timeline, together_timeline = timelines[0], timelines[-1]
    assert len(timelines) >= 2 and {t["since"] for t in timelines} == {"failure_seen"}, timelines
    measured(
        "non-host node killed (--nnodes 1:2)",
        survivor_training_alone=alone,
        **{n.replace(" ", "_"): s for n, s in alone_timeline["phases"]},
    )
    measured(
        "killed node started again",
        training_at_world_size_2=together,
        **{n.replace(" ", "_"): s for n, s in together_timeline["phases"]},
    )


@pytest.mark.timeout(240)
def test_short_link_outage_recovers(cluster: Cluster, tmp_path: Path, reference: Callable[..., Any]) -> None:
    job = Job(cluster, tmp_path, train=[SLOW])
    job.start()
    job.wait_for_step(15)
    t_down = time.time()
    cluster.nodes[1].link(up=False)
    # 2 s: TCP's retransmissions (0.2 + 0.4 + 0.8 + 1.6 s) resume within ~3 s of the link's return, far under the
    # 10 s collective timeout even on a loaded machine; a longer outage would make "rode it out" a race.
    time.sleep(2)
    cluster.nodes[1].link(up=True)
    step_at_outage = max(r["step"] for r in job.records("train") if r["time"] <= t_down)
    progressed = job.wait_for_step(step_at_outage + 2)
    assert job.wait(150) == {"node1": 0, "node2": 0}, job.output()
    assert job.events("resume") == []  # rode it out: no restart
    assert_same_params(final_model_state(job.run_dir), reference())
    measured("link down 2 s", training_again=progressed - t_down)


@pytest.mark.timeout(240)
def test_long_link_outage_ends_every_node_in_bounded_time(cluster: Cluster, tmp_path: Path) -> None:
    job = Job(cluster, tmp_path, launch=["--rdzv-timeout", "15"], train=[SLOW])
    job.start()
    job.wait_for_step(15)
    t_down = time.time()
    cluster.nodes[1].link(up=False)
    codes = job.wait(150)
    took = time.time() - t_down
    assert codes["node1"] != 0 and codes["node2"] != 0, job.output()
    newest = committed_checkpoints(job.run_dir / "checkpoints")[0]
    assert verify_checkpoint(newest).step >= 10
    measured("link down for good", every_node_exited=took)


@pytest.mark.timeout(240)
def test_frozen_worker_detected_dumped_and_restarted(
    cluster: Cluster, tmp_path: Path, reference: Callable[..., Any]
) -> None:
    job = Job(cluster, tmp_path, train=[SLOW])
    job.start()
    job.wait_for_step(15)
    t_stop = time.time()
    for pid in job.workers(cluster.nodes[1]):
        os.kill(pid, signal.SIGSTOP)
    recovery = job.training_again_after(t_stop)
    assert job.wait(150) == {"node1": 0, "node2": 0}, job.output()
    stacks = (job.run_dir / "stacks" / "rank-0-node1.txt").read_text()
    assert "Timed out" in stacks and re.search(r"did not arrive within [0-9.]+ s: rank 1 \(node2\)", stacks), stacks
    # Frozen before the hang watchdog's warm-up ended: the collective timeout reports, with every thread's stack.
    assert "--- all threads at the time of the report:" in stacks
    assert_same_params(final_model_state(job.run_dir), reference())
    measured("worker frozen (SIGSTOP)", training_again=recovery)


@pytest.mark.timeout(240)
def test_sigterm_every_node_stops_together_with_75_then_resumes(
    cluster: Cluster, tmp_path: Path, reference: Callable[..., Any]
) -> None:
    job = Job(cluster, tmp_path, train=[SLOW])
    job.start()
    job.wait_for_step(15)
    t_term = time.time()
    for node in cluster.nodes:  # as a scheduler does: every process of the job gets it
        node.signal_all(signal.SIGTERM)
    assert job.wait(60) == {"node1": EXIT_PREEMPTED, "node2": EXIT_PREEMPTED}, job.output()
    stopped = time.time() - t_term
    [preempted] = job.events("preempted")
    newest = committed_checkpoints(job.run_dir / "checkpoints")[0]
    assert verify_checkpoint(newest).step == preempted["step"] > 15
    assert max(r["step"] for r in job.records("train")) == preempted["step"]
    job.start()  # the same command again
    assert job.wait(150) == {"node1": 0, "node2": 0}, job.output()
    assert job.events("resume")[-1]["step"] == preempted["step"]
    assert_same_params(final_model_state(job.run_dir), reference())
    measured("SIGTERM to every node", all_exited_75=stopped)


@pytest.mark.timeout(240)
def test_sigterm_to_one_node_ends_the_whole_job(cluster: Cluster, tmp_path: Path) -> None:
    job = Job(cluster, tmp_path, train=[SLOW])
    job.start()
    job.wait_for_step(15)
    t_term = time.time()
    job.procs["node2"].send_signal(signal.SIGTERM)  # only node2's launcher (e.g. a pod evicted)
    assert job.wait(60) == {"node1": EXIT_PREEMPTED, "node2": EXIT_PREEMPTED}, job.output()
    stopped = time.time() - t_term
    [preempted] = job.events("preempted")
    assert verify_checkpoint(committed_checkpoints(job.run_dir / "checkpoints")[0]).step == preempted["step"]
    measured("SIGTERM to one node", all_exited_75=stopped)


@pytest.mark.timeout(240)
def test_rate_limited_link_is_slower_with_the_same_result(
    cluster: Cluster, tmp_path: Path, reference: Callable[..., Any]
) -> None:
    big = ["model.kwargs.extra_params=200000", "train.max_steps=20"]  # 800 KB of gradients per step
    cluster.nodes[1].rate_limit("40mbit")
    job = Job(cluster, tmp_path, train=big)
    job.start()
    assert job.wait(200) == {"node1": 0, "node2": 0}, job.output()
    assert_same_params(final_model_state(job.run_dir), reference(*big))
    limited = [r["step_time_s"] for r in job.records("train")[5:]]
    measured("rate-limited link (40 Mbit/s)", median_step=sorted(limited)[len(limited) // 2])


@pytest.mark.timeout(240)
def test_a_link_slowed_mid_run_is_named_with_its_host(namespaces_ok: None, tmp_path: Path) -> None:
    """Three hosts; after the communication baseline, node2's outgoing traffic is limited to 40 Mbit/s.
    The check confirms slow communication, the ranks probe their links and the warning names node2."""
    grads = [
        "model.kwargs.extra_params=200000",
        "model.kwargs.step_sleep=0.03",
        "train.max_steps=110",
        "train.global_batch_size=12",
    ]
    with Cluster(3) as hosts:
        job = Job(hosts, tmp_path, nnodes="3", train=grads)
        job.start()
        job.wait_for_step(50, timeout=150)  # the baseline is the first full 30-step window
        hosts.nodes[1].rate_limit("40mbit")
        limited_at = time.time()
        assert job.wait(200) == {"node1": 0, "node2": 0, "node3": 0}, job.output()
        checks = job.records("ranks")
        found = next((c for c in checks if "slow_comm_ratio" in c), None)
        assert found is not None, [(c["step"], c.get("comm_s"), c.get("comm_baseline_s")) for c in checks]
        assert found["time"] > limited_at
        assert found["slow_comm_host"] == "node2" and found["slow_link"] == "node2's outgoing traffic", found
        assert {(1, 0), (1, 2)} <= {(s, d) for s, d, _ in found["links"]}  # rank 1 runs on node2
        assert not [c for c in checks if "straggler_rank" in c]
        warning = next(
            line for line in job.log(hosts.nodes[0]).read_text().splitlines() if "slow communication" in line
        )
        print("\n" + warning)
        assert "slow: node2's outgoing traffic (probe of 1 MiB: node2 -> node" in warning
        first = min(r["step"] for r in job.records("train") if r["time"] > limited_at)
        print(f"named at step {found['step']}, {found['step'] - first} steps after the limit began")
        measured("slow link named", after_limit=found["time"] - limited_at)
