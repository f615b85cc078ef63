"""The slow-link modes across two namespace hosts whose links are limited with tc tbf (40 Mbit/s each way):
PowerSGD and streaming DiLoCo, each a `ddptrain launch` job per host (--max-restarts 1), both jobs at once on the
same hosts (the PowerSGD job's rendezvous on node1, DiLoCo's on node2). In each job one worker is SIGKILLed once
the checkpoint of step 10 is committed: its launcher restarts every worker from that checkpoint, and the final
weights are bit for bit an uninterrupted 2-rank run's on loopback (helpers.cached_run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import cached_run, final_model_state
from netns import Cluster, Node, hosts_or_skip
from test_multinode_faults import TOY, Job, assert_same_params

from ddptrain.checkpoint import verify_checkpoint

pytestmark = pytest.mark.cluster

STEPS = 20  # checkpoints at 10 and 20
RATE = "40mbit"
COMMON = ["model.kwargs.step_sleep=0.15", f"train.max_steps={STEPS}"]  # ~1.5 s between the kill and step 20's save
POWERSGD = ["dist.grad_compression=powersgd", "dist.powersgd_rank=1", "dist.powersgd_start_step=3"]
# Streaming DiLoCo: fragment 1 syncs after steps 2, 6, 10, ..., fragment 0 after 4, 8, ..., each applied a step later
# (the checkpoint of step 10 holds fragment 1's exchange in flight); both at once after step 20. On the hosts the
# groups are the default, one per node; the loopback reference (one node) names its 2 groups.
DILOCO = ["train.diloco.every_steps=4", "train.diloco.fragments=2", "train.diloco.outer_dtype=int8",
          "train.diloco.delay_steps=1"]  # fmt: skip


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    yield from hosts_or_skip(2)


def children(pid: int) -> list[int]:
    """pid's child processes."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += map(int, (task / "children").read_text().split())
        except OSError:
            pass
    return found


def workers(job: Job, node: Node) -> list[int]:
    """The job's worker pids on a node: the children of its launcher's children (the launcher's own are its
    preloaded fork server, which the workers are forked from, and the resource tracker). Two jobs share the
    namespace, so its pids are not enough; the fork server is spared, as a worker's death spares it."""
    return [worker for helper in children(job.procs[node.hostname].pid) for worker in children(helper)]


def kill_after_checkpoint(kills: dict[str, tuple[Job, Node]], step: int, timeout: float = 150) -> None:
    """SIGKILL each job's workers on its node as soon as the job's checkpoint of `step` is committed."""
    deadline = time.monotonic() + timeout
    while kills:
        for name, (job, node) in list(kills.items()):
            if any(e["step"] == step for e in job.events("checkpoint")):
                pids = workers(job, node)
                assert pids, f"{name}: no worker on {node.hostname}\n{job.output()}"
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                del kills[name]
            elif time.monotonic() > deadline or any(p.poll() is not None for p in job.procs.values()):
                pytest.fail(f"{name}: no checkpoint of step {step}\n{job.output()}")
        time.sleep(0.05)


def tbf_sent_bytes(node: Node) -> int:
    """What the node's rate limiter (its root tbf qdisc) has let out."""
    shown = node.exec("tc", "-s", "qdisc", "show", "dev", node.dev).stdout
    found = re.search(r"qdisc tbf .*?Sent (\d+) bytes", shown, re.DOTALL)
    assert found, shown
    return int(found.group(1))


def assert_resumed_bit_exact(job: Job, reference: Path) -> None:
    """Every launcher exited 0, one restart from the checkpoint of step 10, every step logged, the weights equal."""
    assert job.wait(150) == {"node1": 0, "node2": 0}, job.output()
    assert [(r["step"], r["world_size"]) for r in job.events("resume")] == [(10, 2)], job.output()
    assert sorted({r["step"] for r in job.records("train")}) == list(range(1, STEPS + 1))
    losses = {r["step"]: r["loss"] for r in job.records("train")}  # a step trained again: its last record
    expected = {r["step"]: r["loss"] for r in map(json.loads, (reference / "metrics.jsonl").read_text().splitlines())
                if r["kind"] == "train"}  # fmt: skip
    assert losses == expected
    assert_same_params(final_model_state(job.run_dir), final_model_state(reference))


@pytest.mark.timeout(240)
def test_powersgd_and_streaming_diloco_on_limited_links_resume_bit_exact_after_a_kill(
    cluster: Cluster, tmp_path: Path, reference_cache: Path
) -> None:
    node1, node2 = cluster.nodes
    for node in cluster.nodes:
        node.rate_limit(RATE)
    restarts = ["--max-restarts", "1"]
    powersgd = Job(cluster, tmp_path / "powersgd", launch=restarts, train=[*COMMON, *POWERSGD])
    diloco = Job(cluster, tmp_path / "diloco", launch=restarts, train=[*COMMON, *DILOCO])
    diloco.host = node2  # its rendezvous (the same port) on the other host
    for job in (powersgd, diloco):
        job.tmp.mkdir()
        job.start()
    kill_after_checkpoint({"powersgd": (powersgd, node2), "diloco": (diloco, node1)}, step=10)
    reference = [
        cached_run(reference_cache, ["train", *TOY, *COMMON, *extra, "run.dir={out}"], nproc=2)
        for extra in (POWERSGD, [*DILOCO, "train.diloco.groups=2"])
    ]  # trained meanwhile on loopback
    assert_resumed_bit_exact(powersgd, reference[0])
    assert_resumed_bit_exact(diloco, reference[1])

    # PowerSGD: its state (each rank's error feedback, the shared factors) came back from the checkpoint.
    said = "\n".join(job.log(n).read_text() for job in (powersgd,) for n in cluster.nodes)
    assert "fresh error feedback" not in said
    manifest = json.loads((powersgd.run_dir / "checkpoints" / "step-00000010" / "manifest.json").read_text())
    assert sorted(n for n in manifest["files"] if n.startswith("grad_compression-")) == [
        "grad_compression-rank0.pt",
        "grad_compression-rank1.pt",
    ]
    rank0 = (powersgd.run_dir / "logs" / "rank-0.log").read_text()
    sizes = re.search(
        r"dist\.grad_compression=powersgd: ([0-9.]+) MB per step's all-reduce instead of ([0-9.]+)", rank0
    )
    assert sizes and 0 < float(sizes[1]) < float(sizes[2]), rank0[-2000:]

    # Streaming DiLoCo: one group per host, the outer syncs counted through the restart, int8 bytes sent.
    records = {r["step"]: r for r in diloco.records("train")}  # a step trained again: its last record
    assert {r["diloco_groups"] for r in records.values()} == {2}
    assert [records[s]["outer_syncs"] for s in range(1, STEPS + 1)] == [(s - 1) // 2 for s in range(1, STEPS)] + [10]
    sent = {s: r["outer_sent_bytes"] for s, r in records.items() if r["outer_sent_bytes"]}
    assert sorted(sent) == list(range(2, STEPS + 1, 2)) and all(b > 0 for b in sent.values()), sent
    in_flight = verify_checkpoint(diloco.run_dir / "checkpoints" / "step-00000010").load("diloco-rank1.pt")
    assert in_flight["in_flight"]["fragments"] == [1]  # the restarted workers launched that exchange again

    # Both hosts' traffic went through their rate limiters.
    assert all(tbf_sent_bytes(node) > 0 for node in cluster.nodes)
