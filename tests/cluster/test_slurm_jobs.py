"""Jobs written by `ddptrain slurm --submit` on a real SLURM cluster (slurmctld + slurmd on loopback).

Preemption is made the way an operator or SLURM's own `--signal` does it: USR1 to the batch
shell (`scancel --signal=USR1 --batch`). The job must commit a checkpoint, exit 75, requeue
itself, resume and end with the same parameters as an uninterrupted run. SLURM holds every
requeued job back for cred_expire + 1 seconds (121 s by default); the test cluster sets
cred_expire=10 so that this takes seconds (see slurm_harness.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import torch
from etcd_harness import etcd_missing, loopback_etcd
from helpers import TINY, env_for_subprocess, final_model_state, read_metrics
from slurm_harness import REQUEUE_DELAY_S, SlurmCluster, report, skip_reason

pytestmark = pytest.mark.cluster

# Enough steps that a USR1 sent after the first logged steps lands mid-run; checkpoints only at the
# end, so a resume can only start from the preemption checkpoint.
STEPS = 300
LONG = [f"train.max_steps={STEPS}", "ckpt.every_steps=0", "log.every_steps=1"]
# One node, two ranks; stop-window estimates small enough for a short --signal lead.
JOB = [
    "--nodes",
    "1",
    "--nproc-per-node",
    "2",
    "--cpus-per-node",
    "2",
    "--mem",
    "1G",
    "--signal-seconds",
    "60",
    "--save-seconds",
    "10",
    "--step-seconds",
    "5",
]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[SlurmCluster]:
    """A fresh SLURM cluster for this module's tests, stopped by pid files at the end."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    report(pytestconfig, f"SLURM cluster (munged, slurmctld, slurmd) up and idle in {cluster.started_s:.2f} s")
    try:
        yield cluster
    finally:
        cluster.stop()


def _submit(slurm: SlurmCluster, cwd: Path, args: list[str]) -> str:
    """`ddptrain slurm ... --submit` as a user would type it; returns the job id."""
    return _submit_together(slurm, [(cwd, args)])[0]


def _submit_together(slurm: SlurmCluster, jobs: list[tuple[Path, list[str]]]) -> list[str]:
    """Several `ddptrain slurm ... --submit` at once (each imports torch first: on a loaded machine one
    after the other could submit the second job after the first one ended); returns the job ids."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ddptrain", "slurm", *args, "--submit"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=slurm.env(env_for_subprocess()),
        )
        for cwd, args in jobs
    ]
    ids = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        match = re.search(r"submitted job (\d+)", out)
        assert match, out
        ids.append(match.group(1))
    return ids


def _job_log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm").glob("*.out")))


def _wait_for_step(run_dir: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(r["step"] >= step for r in read_metrics(run_dir)):
                return
        except (OSError, json.JSONDecodeError):  # not written yet, or a line half-written
            pass
        time.sleep(0.05)
    raise AssertionError(f"training did not reach step {step} within {timeout} s:\n{_job_log(run_dir)}")


@pytest.fixture(scope="module")
def uninterrupted(
    slurm: SlurmCluster, corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, str]]:
    """A job of the preemption test's config that nobody interrupts: its run dir and final job fields."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job = _submit(slurm, tmp, [*TINY, *LONG, f"data.dir={corpus_dir}", f"run.dir={tmp / 'run'}", *JOB])
    return tmp / "run", slurm.wait_for(job, DONE, 180)


@pytest.mark.timeout(240)
def test_submitted_job_trains_to_the_end(uninterrupted: tuple[Path, dict[str, str]]) -> None:
    run_dir, info = uninterrupted
    log = _job_log(run_dir)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", f"{info}\n{log}"
    assert "ddptrain-slurm: training finished" in log
    train = read_metrics(run_dir)
    assert train[-1]["step"] == STEPS and train[-1]["world_size"] == 2
    assert (run_dir / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").is_file()


@pytest.mark.timeout(300)
def test_preempted_job_requeues_and_resumes_to_the_same_parameters(
    slurm: SlurmCluster,
    uninterrupted: tuple[Path, dict[str, str]],
    corpus_dir: Path,
    tmp_path: Path,
    pytestconfig: pytest.Config,
) -> None:
    run_dir = tmp_path / "run"
    job = _submit(slurm, tmp_path, [*TINY, *LONG, f"data.dir={corpus_dir}", f"run.dir={run_dir}", *JOB])
    _wait_for_step(run_dir, 2, timeout=120)
    signalled = time.time()
    slurm.run(["scancel", "--signal=USR1", "--batch", job])
    info = slurm.wait_for(job, DONE, 200)
    log = _job_log(run_dir)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", f"{info}\n{log}"
    assert "USR1 received" in log and "preempted, checkpoint committed; requeueing" in log
    assert any(e["event"] == "preempted" for e in read_metrics(run_dir, "event"))

    events = read_metrics(run_dir, "event")
    resumed = [e for e in events if e["event"] == "resume"]
    assert len(resumed) == 1, events
    stop_step = resumed[0]["step"]
    assert 2 <= stop_step < STEPS, "the preemption checkpoint must be mid-run"
    train = read_metrics(run_dir)
    # Every step ran exactly once across the two attempts: nothing lost, nothing repeated.
    assert sorted(r["step"] for r in train) == list(range(1, STEPS + 1))

    final, expected = final_model_state(run_dir), final_model_state(uninterrupted[0])
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=0, msg=f"parameter {name} differs")

    requeued = _log_time(log, r"requeueing job \d+ at (\S+)")
    restarted = _log_time(log, r"restart 1 on \S+, rendezvous \S+, (\S+)")
    report(
        pytestconfig,
        f"preemption: USR1 -> checkpoint at step {stop_step} + exit 75 + requeue "
        f"{requeued - signalled:.1f} s; requeue -> job running again {restarted - requeued:.1f} s "
        f"(SLURM's requeue hold, cred_expire+1 = {REQUEUE_DELAY_S} s here, 121 s by default); "
        f"USR1 -> training resumed {resumed[0]['time'] - signalled:.1f} s",
    )


def _log_time(log: str, pattern: str) -> float:
    """Epoch seconds of the first ISO timestamp the job script logged on a line matching pattern."""
    match = re.search(pattern, log)
    assert match, f"{pattern!r} not in the job log:\n{log}"
    return datetime.fromisoformat(match.group(1)).timestamp()


@pytest.mark.timeout(240)
def test_crashing_job_is_requeued_only_up_to_its_bound(slurm: SlurmCluster, corpus_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # A model factory that raises (a negative width): every attempt crashes with exit 1, not 2 or 75.
    job = _submit(
        slurm,
        tmp_path,
        [
            *TINY,
            f"data.dir={corpus_dir}",
            "model.target=toy:build_model",
            "model.kwargs.dim=-1",
            f"run.dir={run_dir}",
            *JOB,
            "--nproc-per-node",
            "1",
            "--max-requeues",
            "1",
            "--max-restarts",
            "0",
        ],
    )
    info = slurm.wait_for(job, DONE, 200)
    log = _job_log(run_dir)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0" and info["Restarts"] == "1", f"{info}\n{log}"
    assert log.count("requeueing") == 1 and "after 1 requeues; giving up" in log
    assert (run_dir / "slurm" / f"crashes-{job}").read_text().strip() == "2"


@pytest.mark.timeout(300)
def test_two_jobs_on_the_same_head_node_at_once_both_finish(
    slurm: SlurmCluster, corpus_dir: Path, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    """Each job's rendezvous port comes from its job id: two jobs on the same head node do not collide."""
    one_cpu = [
        "--nodes",
        "1",
        "--nproc-per-node",
        "1",
        "--cpus-per-node",
        "1",
        "--mem",
        "1G",
        "--signal-seconds",
        "60",
        "--save-seconds",
        "10",
        "--step-seconds",
        "5",
    ]
    runs, submissions = [tmp_path / "a" / "run", tmp_path / "b" / "run"], []
    for run_dir, steps in zip(runs, (40, 60)):
        run_dir.parent.mkdir()
        config = [
            *TINY,
            f"train.max_steps={steps}",
            "log.every_steps=1",
            f"data.dir={corpus_dir}",
            f"run.dir={run_dir}",
        ]
        submissions.append((run_dir.parent, [*config, *one_cpu]))
    jobs = _submit_together(slurm, submissions)
    infos = [slurm.wait_for(job, DONE, 240) for job in jobs]
    logs = [_job_log(run_dir) for run_dir in runs]
    for info, log in zip(infos, logs):
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    endpoints = [re.search(r"rendezvous (\S+),", log).group(1) for log in logs]  # type: ignore[union-attr]
    assert endpoints[0] != endpoints[1]
    assert all(e.endswith(f":{10000 + int(j) % 20000}") for e, j in zip(endpoints, jobs))
    # They ran at the same time on the one node: B started before A ended.
    assert infos[1]["StartTime"] < infos[0]["EndTime"] and infos[0]["NodeList"] == infos[1]["NodeList"], infos
    for run_dir, steps in zip(runs, (40, 60)):
        assert read_metrics(run_dir)[-1]["step"] == steps
    report(
        pytestconfig,
        f"two concurrent jobs on {infos[0]['NodeList']} finished, rendezvous {endpoints[0]} and {endpoints[1]}",
    )


@pytest.mark.timeout(180)
def test_job_with_etcd_endpoints_meets_in_etcd(
    slurm: SlurmCluster, corpus_dir: Path, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    """--etcd-endpoints: the job's launcher rendezvous through a real etcd under the id the script names."""
    reason = etcd_missing()
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path / "run"
    with loopback_etcd(tmp_path) as endpoint:
        config = [*TINY, "train.max_steps=5", f"data.dir={corpus_dir}", f"run.dir={run_dir}"]
        job = _submit(slurm, tmp_path, [*config, *JOB, "--etcd-endpoints", endpoint])
        info = slurm.wait_for(job, DONE, 150)
        log = _job_log(run_dir)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
        assert f"rendezvous {endpoint}," in log
        cluster = re.search(r"ClusterName=(\S+)", slurm.conf.read_text()).group(1)  # type: ignore[union-attr]
        key = f"http://{endpoint}/v2/keys/torch/elastic/rendezvous/slurm-{cluster}-{job}"
        with urllib.request.urlopen(key, timeout=5) as answer:  # the rendezvous state the job left in etcd
            assert json.load(answer)["node"]["key"].endswith(f"slurm-{cluster}-{job}")
    assert read_metrics(run_dir)[-1]["step"] == 5 and read_metrics(run_dir)[-1]["world_size"] == 2
    report(pytestconfig, f"a job with --etcd-endpoints {endpoint} finished through etcd")
