"""MLflow tracking against a real `mlflow server` (SQLite backend, local artifacts) on 127.0.0.1.

One server per module (it takes 10-30 s to start here). A run killed with SIGKILL under torchrun
and resumed at another world size stays one MLflow run whose metric history holds each step once,
in order; a server stopped mid-run costs training nothing and loses nothing silently.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import run_ddptrain, start_ddptrain
from tracking_harness import MlflowServer

pytestmark = pytest.mark.dist
pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'ddptrain[mlflow]')")

GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
STEPS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    s = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    s.start()
    yield s
    s.stop()


def tracked(server: MlflowServer, experiment: str) -> list[str]:
    return ["log.trackers=[mlflow]", f"log.mlflow.tracking_uri={server.uri}", f"log.mlflow.experiment={experiment}"]


def steps_of(client: object, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]  # type: ignore[attr-defined]


def only_run(client: object, experiment: str) -> object:
    exp = client.get_experiment_by_name(experiment)  # type: ignore[attr-defined]
    runs = client.search_runs([exp.experiment_id])  # type: ignore[attr-defined]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


@pytest.mark.timeout(420)
def test_two_ranks_killed_then_resumed_at_one_rank_is_one_run(
    server: MlflowServer, corpus_dir: Path, tmp_path: Path
) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    kwargs = {**GPT, "die_at_call": 4 * 2 + 1, "marker": str(marker), "rank": 0}  # 1st micro-batch of step 5
    args = [
        "train",
        f"data.dir={corpus_dir}",
        f"run.dir={run_dir}",
        "model.block_size=32",
        "model.target=toy:build_killable_gpt",
        "model.kwargs=" + str(kwargs).replace("'", ""),
        "data.micro_batch_size=4",
        "train.global_batch_size=16",
        f"train.max_steps={STEPS}",
        "train.warmup_steps=2",
        "train.eval_every=4",
        "log.every_steps=1",
        "ckpt.every_steps=3",
        *tracked(server, "killed-and-resumed"),
        "log.track_artifacts=[report,model]",
    ]
    first = run_ddptrain(args, nproc=2, timeout=200)
    assert first.returncode != 0 and marker.exists(), first.stdout + first.stderr
    second = run_ddptrain(args, timeout=200)  # world size 1 now: accumulation 4 instead of 2
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from" in second.stdout and "step-00000003" in second.stdout

    client = server.client()
    run = only_run(client, "killed-and-resumed")
    run_id = run.info.run_id  # type: ignore[attr-defined]
    assert run_id in (run_dir / "trackers.json").read_text()
    assert steps_of(client, run_id, "train/loss") == list(range(1, STEPS + 1))  # each step once, in order
    assert steps_of(client, run_id, "eval/val_loss") == [4, 8]
    tags, params = run.data.tags, run.data.params  # type: ignore[attr-defined]
    assert params["train.lr"] == "0.003" and params["train.global_batch_size"] == "16"
    assert tags["ddptrain.attempts"] == "2" and tags["ddptrain.label.resumed"] == "true"
    assert tags["ddptrain.attempt.2"].startswith("resume at step 3, world size 1")
    assert tags["ddptrain.world_size_change.2"] == "2 -> 1 at step 3"
    assert tags["sys.world_size"] == "1" and tags["sys.torch"].startswith("2.")
    assert tags["ddptrain.status"] == "completed" and run.info.status == "FINISHED"  # type: ignore[attr-defined]
    uploaded = {a.path for folder in ("report", "model") for a in client.list_artifacts(run_id, folder)}
    assert {"report/loss.png", "report/summary.txt", "model/model.safetensors", "model/model.json"} <= uploaded


def wait_for(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.timeout(420)
def test_server_down_mid_run_training_finishes_and_counts_what_it_lost(server: MlflowServer, tmp_path: Path) -> None:
    """Steps 1-4 delivered, server stopped for steps 5-16, back for 17-20 (the model waits at calls 5 and 17).

    Six records fit in the queue: the oldest of those logged while the server is down are dropped.
    """
    run_dir, gates = tmp_path / "run", tmp_path / "gates"
    gates.mkdir()
    model = {"dim": 8, "gates": [5, 17], "gate_dir": str(gates)}
    args = [
        "train",
        f"run.dir={run_dir}",
        "model.target=tracker_toy:build_gated_model",
        "model.kwargs=" + str(model).replace("'", ""),
        "data.target=toy:build_datasets",
        "data.micro_batch_size=8",
        "train.global_batch_size=8",
        "train.max_steps=20",
        "train.eval_every=0",
        "log.every_steps=1",
        "ckpt.every_steps=0",
        "log.tracker_buffer=6",
        "log.tracker_flush_s=90",
        *tracked(server, "outage"),
    ]
    proc = start_ddptrain(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = server.client()
        wait_for(lambda: (gates / "waiting-5").exists(), 120, "step 5")
        run_id = lambda: re.search(r'"run_id": "(\w+)"', (run_dir / "trackers.json").read_text()).group(1)  # noqa: E731
        wait_for(
            lambda: (run_dir / "trackers.json").exists() and "run_id" in (run_dir / "trackers.json").read_text(),
            60,
            "the MLflow run",
        )
        wait_for(lambda: steps_of(client, run_id(), "train/loss") == [1, 2, 3, 4], 60, "steps 1-4 on the server")
        server.stop()
        (gates / "go-5").write_text("")
        wait_for(lambda: (gates / "waiting-17").exists(), 120, "step 17 (steps 5-16 trained, server down)")
        server.start()
        (gates / "go-17").write_text("")
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert "done: 20 steps" in out
    failures = [line for line in out.splitlines() if line.startswith("warning: mlflow") and "retrying every" in line]
    assert len(failures) == 1, out  # one warning for the outage, not one per record
    assert len([line for line in out.splitlines() if "reachable again" in line]) == 1, out
    dropped = sum(int(n) for n in re.findall(r"(\d+) record\(s\) were dropped", out))
    steps = steps_of(client, run_id(), "train/loss")
    assert steps == sorted(set(steps)), steps  # in order, each once
    assert set(range(1, 5)) | set(range(17, 21)) <= set(steps)  # before and after the outage: all there
    assert len(steps) + dropped == 20, (steps, out)  # what is missing was counted in a warning
    assert dropped > 0, out  # 12 records logged while down, 6 fit in the queue
    assert client.get_run(run_id()).info.status == "FINISHED"


def runs_of(client: object, experiment: str) -> list[object]:
    exp = client.get_experiment_by_name(experiment)  # type: ignore[attr-defined]
    return client.search_runs([exp.experiment_id]) if exp is not None else []  # type: ignore[attr-defined]


@pytest.mark.timeout(420)
def test_killed_as_its_run_opens_then_interrupted_then_finished_is_one_run(
    server: MlflowServer, tmp_path: Path
) -> None:
    """SIGKILL the moment the server holds the new run (before any metric), resume and Ctrl-C it, resume to
    the end: one MLflow run throughout, KILLED after the Ctrl-C, FINISHED at the end, each ending tagged."""
    run_dir, gates, log = tmp_path / "run", tmp_path / "gates", tmp_path / "attempts.log"
    gates.mkdir()
    model = {"dim": 8, "gates": [1, 5], "gate_dir": str(gates)}  # waits at the forwards of steps 1 and 5
    args = [
        "train",
        f"run.dir={run_dir}",
        "model.target=tracker_toy:build_gated_model",
        "model.kwargs=" + str(model).replace("'", ""),
        "data.target=toy:build_datasets",
        "data.micro_batch_size=8",
        "train.global_batch_size=8",
        "train.max_steps=8",
        "train.eval_every=0",
        "log.every_steps=1",
        "ckpt.every_steps=0",
        *tracked(server, "killed-as-it-opens"),
    ]

    def start() -> Any:  # SIGINT handled as in a terminal (start_ddptrain's processes have it so)
        return start_ddptrain(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT)

    client = server.client()
    proc = start()
    try:
        wait_for(lambda: runs_of(client, "killed-as-it-opens") or proc.poll() is not None, 120, "the MLflow run")
        proc.send_signal(signal.SIGKILL)  # the run exists on the server; its id may not be stored yet
        proc.wait(30)
        assert "run_key" in (run_dir / "trackers.json").read_text()  # recorded before MLflow was called
        (gates / "go-1").write_text("")
        proc = start()
        wait_for(lambda: (gates / "waiting-5").exists() or proc.poll() is not None, 120, "step 5")
        proc.send_signal(signal.SIGINT)  # taken when step 5 ends: a checkpoint, then exit 130
        (gates / "go-5").write_text("")
        assert proc.wait(120) == 130, log.read_text()[-3000:]
        run = only_run(client, "killed-as-it-opens")
        assert run.info.status == "KILLED"  # type: ignore[attr-defined]
        tags = run.data.tags  # type: ignore[attr-defined]
        assert tags["ddptrain.ending.1"].startswith("crashed: no end record"), tags
        assert tags["ddptrain.ending.2"] == "interrupted by SIGINT at step 5, checkpoint committed (exit 130)"
        assert tags["ddptrain.status"] == "interrupted"
        proc = start()
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = only_run(client, "killed-as-it-opens")  # never a second run
    run_id, tags = run.info.run_id, run.data.tags  # type: ignore[attr-defined]
    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert state["run_id"] == run_id and tags["ddptrain.run_key"] == state["run_key"]
    assert run.info.status == "FINISHED" and tags["ddptrain.status"] == "completed"  # type: ignore[attr-defined]
    assert tags["ddptrain.attempts"] == "3" and tags["ddptrain.ending.3"] == "completed at step 8 (exit 0)"
    assert steps_of(client, run_id, "train/loss") == list(range(1, 9))


@pytest.mark.timeout(300)
def test_metrics_of_your_own_and_an_early_stop_reach_mlflow(server: MlflowServer, tmp_path: Path) -> None:
    """tests/metrics_toy.py's metrics and train.metrics' are series of their own; an early stop is FINISHED."""
    args = [
        "train",
        f"run.dir={tmp_path / 'run'}",
        "model.target=metrics_toy:plateau_model",
        "model.kwargs={peak: 2}",
        "data.target=varlen_toy:bare_datasets",
        "train.metrics=metrics_toy:target_mean",
        "data.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.max_steps=20",
        "train.warmup_steps=0",
        "train.eval_every=2",
        "train.eval_batches=1",
        "log.every_steps=1",
        "ckpt.every_steps=0",
        "train.early_stop={metric: val_plateau, mode: max, patience: 1}",
        *tracked(server, "own-metrics"),
    ]
    done = run_ddptrain(args, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    client = server.client()
    run = only_run(client, "own-metrics")
    run_id = run.info.run_id  # type: ignore[attr-defined]
    for name in ("abs_err", "plateau", "target_mean"):  # plateau: 2 from step 2 on (accumulation 2, peak 2)
        assert steps_of(client, run_id, f"train/{name}") == [1, 2, 3, 4], name
        assert steps_of(client, run_id, f"eval/val_{name}") == [2, 4], name
    assert run.info.status == "FINISHED" and run.data.tags["ddptrain.status"] == "finished_early"  # type: ignore[attr-defined]
