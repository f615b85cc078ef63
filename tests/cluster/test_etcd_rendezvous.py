"""The etcd rendezvous on namespace hosts: real etcd members (Debian's etcd-server), real launchers.

Training hosts run `ddptrain launch --rdzv-backend etcd-v2` with one worker each (the tiny
regression model of test_multinode_faults.py); etcd runs on hosts of its own, so losing any
training host, or one etcd member of three, takes nothing the job needs away. Final parameters
are compared with a plain torchrun run resumed from the same restore point (bit-exact on CPU).
Each test prints MEASURED lines (run with -s).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from etcd_harness import endpoints, etcd_missing, free_port, loopback_etcd, start_etcd
from helpers import final_model_state, start_ddptrain
from netns import Cluster, Node, unavailable_reason
from test_multinode_faults import Job, assert_same_params, measured

from ddptrain.checkpoint import committed_checkpoints
from ddptrain.checkpoint.manifest import step_of
from ddptrain.cli import main

pytestmark = pytest.mark.cluster

# A global batch of 12 = 2 x 2 hosts x 3 = 2 x 3 hosts x 2; ~0.1 s per step.
ELASTIC = [
    "data.micro_batch_size=2",
    "train.global_batch_size=12",
    "ckpt.every_steps=5",
    "ckpt.keep=20",
    "model.kwargs.step_sleep=0.1",
]
ETCD_LAUNCH = [
    "--rdzv-backend",
    "etcd-v2",
    "--rdzv-timeout",
    "30",
    # A host whose launcher starts late on a busy machine still makes the first round: it closes 6 s after
    # the second host joined (with 2 s a third host missed it at load 8, and waiting for the next round
    # took the survivors past the rendezvous timeout). After a host is lost, the survivors wait as long.
    "--rdzv-last-call",
    "6",
    # A lost host is dropped from the rendezvous 5 s after its last heartbeat. With 3 s (and a 20 s rendezvous
    # timeout) the survivors of a lost rank-0 host once failed to re-form in time at the start of a CI run (3 test
    # workers beside the type checker), on a machine that sends a heartbeat a second.
    "--rdzv-conf",
    "keep_alive_interval=1,keep_alive_max_attempt=5,read_timeout=5",
]


@pytest.fixture(scope="module")
def etcd_binary() -> None:
    reason = etcd_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def etcd_ok() -> None:
    reason = unavailable_reason() or etcd_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def hosts(etcd_ok: None, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """`request.param` fresh hosts; everything in them is killed and removed afterwards, pass or fail."""
    c = Cluster(request.param)
    try:
        yield c
    finally:
        c.close()


class EtcdJob(Job):
    """Job whose launchers rendezvous through etcd members (on other hosts of the same cluster)."""

    def __init__(self, cluster: Cluster, tmp: Path, trainers: list[Node], members: list[Node], **kw: object) -> None:
        super().__init__(cluster, tmp, **kw)  # type: ignore[arg-type]
        self.trainers, self.members = trainers, members
        self.launch_opts = [*self.launch_opts, *ETCD_LAUNCH]

    def argv(self, node: Node) -> list[str]:
        argv = super().argv(node)
        at = argv.index("--rdzv-endpoint")
        argv[at + 1] = endpoints(self.members)
        return [*argv[: at + 2], "--run-id", f"etcd-{self.cluster.tag}", *argv[at + 2 :]]

    def start(self, *nodes: Node) -> None:
        super().start(*(nodes or self.trainers))

    def wait(self, timeout: float, *nodes: Node) -> dict[str, int]:
        return super().wait(timeout, *(nodes or self.trainers))

    def rank0_host(self) -> Node:
        """The training host of rank 0 (it holds the workers' store: today's host role), from rank 0's own record."""
        starts = [r for r in self.records("event") if r["event"] in ("start", "resume")]
        host = starts[-1]["host"] if starts else None
        for node in self.trainers:
            if node.hostname == host:
                return node
        pytest.fail(f"rank 0's host {host!r} is none of the training hosts\n{self.output()}")


class Reference:
    """A local run of the job's training on world_size ranks (`ddptrain launch`), started now, run beside the job.

    Started while the job still trains (its steps mostly sleep), so the comparison costs little wall time.
    """

    def __init__(self, job: EtcdJob, tmp: Path, world_size: int, *extra: str) -> None:
        self.run_dir = tmp / "reference"
        self.log = open(tmp / "reference.log", "wb")
        args = ["train", *job.train_args[:-1], f"run.dir={self.run_dir}", *extra]
        self.proc = start_ddptrain(args, nproc=world_size, stdout=self.log, stderr=subprocess.STDOUT)

    def params(self, timeout: float = 90) -> dict[str, torch.Tensor]:
        """The reference's final parameters, once it has finished."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        assert code == 0, (self.run_dir.parent / "reference.log").read_text()[-3000:]
        return final_model_state(self.run_dir)


def restore_point(job: EtcdJob, step: int) -> Path:
    """The job's committed checkpoint of `step`."""
    [ckpt] = [p for p in committed_checkpoints(job.run_dir / "checkpoints") if step_of(p.name) == step]
    return ckpt


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hosts", [4], indirect=True)
def test_rank0_host_lost_then_back_at_three(hosts: Cluster, tmp_path: Path) -> None:
    """(a) 3 training hosts, --nnodes 2:3, etcd on a fourth: kill the rank-0 host, then start it again."""
    t0 = time.time()
    *trainers, member = hosts.nodes
    start_etcd([member], tmp_path)
    job = EtcdJob(hosts, tmp_path, trainers, [member], nnodes="2:3", train=[*ELASTIC, "train.max_steps=60"])
    job.start()
    # All three in the first round, or in the next one when a host was slow to start: wait for 3 training.
    job.wait_for("training at world size 3", lambda: [r for r in job.records("train") if r["world_size"] == 3], 60)
    job.wait_for_step(job.records("train")[-1]["step"] + 5, timeout=30)
    lost = job.rank0_host()
    t_kill = time.time()
    lost.kill_all()
    at_two = job.training_again_after(t_kill, world_size=2, timeout=60)
    resumed = job.events("resume")[-1]
    assert (resumed["world_size"], resumed["grad_accum"]) == (2, 3)  # the global batch of 12 is kept
    assert all(r["global_batch_size"] == 12 for r in job.records("train") if r["time"] > resumed["time"])
    t_back = time.time()
    job.start(lost)
    # The others stop gracefully for the returning host and commit a checkpoint: the world-size-3 segment
    # restores from it. On a busy machine the returning host can miss the first round re-formed for it (the
    # others train on at 2 and stop again once it waits again): the restore point is the stop it resumed from.
    at_three = job.training_again_after(t_back, world_size=3, timeout=90)
    resumed = next(e for e in job.events("resume") if e["time"] > t_back and e["world_size"] == 3)
    stops = [e["step"] for e in job.events("preempted") if t_back < e["time"] < resumed["time"]]
    assert stops and stops[-1] == resumed["step"], (stops, resumed)
    reference = Reference(job, tmp_path, 3, f"ckpt.resume={restore_point(job, resumed['step'])}")
    assert job.wait(60) == {n.hostname: 0 for n in trainers}, job.output()
    t_end = time.time()
    assert job.events("resume")[-1] == resumed
    last = job.records("train")[-1]
    assert (last["step"], last["world_size"], last["grad_accum"]) == (60, 3, 2)
    assert_same_params(final_model_state(job.run_dir), reference.params())
    measured("etcd: rank-0 host killed (--nnodes 2:3)", training_at_world_size_2=at_two)
    measured("etcd: killed host started again", training_at_world_size_3=at_three, job_done=t_end - t0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hosts", [5], indirect=True)
def test_one_etcd_member_of_three_lost(hosts: Cluster, tmp_path: Path) -> None:
    """(b) 2 training hosts, 3 etcd members: the member listed first dies mid-run; training never notices."""
    t0 = time.time()
    trainers, members = hosts.nodes[:2], hosts.nodes[2:]
    start_etcd(members, tmp_path)
    job = EtcdJob(hosts, tmp_path, trainers, members, train=["model.kwargs.step_sleep=0.1", "train.max_steps=40"])
    job.start()
    reference = Reference(job, tmp_path, 2)
    job.wait_for_step(5, timeout=60)
    t_kill = time.time()
    members[0].kill_all()  # every client starts on the first endpoint: they must move to another
    step_at_loss = max(r["step"] for r in job.records("train"))
    assert job.wait(90) == {"node1": 0, "node2": 0}, job.output()
    t_end = time.time()
    trained_after = [r for r in job.records("train") if r["time"] > t_kill]
    assert step_at_loss < 40 and trained_after, "the member was lost after training ended: nothing was tested"
    assert job.events("resume") == [], job.output()  # untouched: no restart, no new rendezvous
    assert_same_params(final_model_state(job.run_dir), reference.params())
    measured("etcd: one member of three killed", job_end_after_loss=t_end - t_kill, job_done=t_end - t0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", [2], indirect=True)
def test_etcd_unreachable_at_start_exits_1_naming_it(hosts: Cluster, tmp_path: Path) -> None:
    """(c) nothing listens at the etcd endpoint: exit 1 within the rendezvous timeout, naming the endpoint."""
    trainer, nowhere = hosts.nodes
    job = EtcdJob(hosts, tmp_path, [trainer], [nowhere], nnodes="1:2", train=["train.max_steps=5"])
    job.launch_opts += ["--rdzv-timeout", "4"]
    t0 = time.time()
    job.start()
    assert job.wait(40) == {"node1": 1}, job.output()
    took = time.time() - t0
    log = job.log(trainer).read_text()
    line = next((x for x in log.splitlines() if "no etcd member was healthy" in x), None)
    assert line is not None and f"{nowhere.addr}:2379" in line and "within 4 s" in line, log
    assert "Traceback" not in log, log
    measured("etcd unreachable at start", launcher_exit=took)


@pytest.mark.timeout(60)
def test_doctor_checks_every_etcd_member(etcd_binary: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ddptrain doctor --etcd`: a healthy member passes, a dead one warns beside it, v2 off is named."""
    closed = f"127.0.0.1:{free_port()}"
    with loopback_etcd(tmp_path) as good, loopback_etcd(tmp_path, v2=False) as no_v2:
        t0 = time.time()
        assert main(["doctor", "--max-mb", "0.001", "--timeout", "2", "--etcd", good]) == 0
        assert "PASS  etcd        all 1 member(s) healthy, v2 API on" in capsys.readouterr().out
        assert main(["doctor", "--max-mb", "0.001", "--timeout", "2", "--etcd", f"{good},{closed}"]) == 0
        out = capsys.readouterr().out
        assert "WARN  etcd        1 of 2 healthy" in out and f"{closed}: Connection refused" in out, out
        assert main(["doctor", "--max-mb", "0.001", "--timeout", "2", "--etcd", no_v2]) == 1
        out = capsys.readouterr().out
        assert "FAIL  etcd        0 of 1 healthy" in out and "start etcd with --enable-v2" in out, out
        measured("doctor etcd checks (3 runs)", doctor=time.time() - t0)
