"""The delivery thread behind MLflow and W&B, with an in-memory tracker that can be taken down.

MemoryTracker is a real implementation of the tracker interface (observe/trackers/base.py) that
keeps a server's state in memory; `down` makes every call raise, like an unreachable server.
"""

from __future__ import annotations

import csv
import json
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import one_line_exit_2, read_metrics
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddptrain.config import load_config
from ddptrain.errors import ConfigError
from ddptrain.observe.trackers import require_packages, tracker_names
from ddptrain.observe.trackers.background import BackgroundTracker, Backlog
from ddptrain.observe.trackers.base import Opened, StartInfo, Update, flatten
from ddptrain.observe.trackers.state import TrackerState


class Server:
    """What a tracking server holds: runs with their metric history and tags."""

    def __init__(self) -> None:
        self.history: dict[str, list[tuple[str, int, float]]] = {}
        self.tags: dict[str, dict[str, str]] = {}
        self.status: dict[str, str] = {}
        self.down = threading.Event()


class MemoryTracker:
    name = "memory"

    def __init__(self, server: Server) -> None:
        self.server = server
        self.run_id = ""
        self.killed = False  # this process was SIGKILLed: nothing it still holds reaches the server

    def _check(self) -> None:
        if self.server.down.is_set() or self.killed:
            raise ConnectionError("connection refused")

    def open(self, run_id: str | None, start: StartInfo) -> Opened:
        self._check()
        self.run_id = run_id or f"run{len(self.server.history)}"
        self.server.history.setdefault(self.run_id, [])
        self.server.tags.setdefault(self.run_id, {}).update({k: str(v) for k, v in start.params.items()})
        return Opened(self.run_id)

    def send(self, update: Update) -> None:
        self._check()
        self.server.history[self.run_id] += [(p.key, p.step, p.value) for p in update.points]
        self.server.tags[self.run_id].update(update.tags)

    def upload(self, folder: Path, kind: str) -> None:
        self._check()

    def finish(self, status: str) -> None:
        self._check()
        self.server.status[self.run_id] = status


def attempt(
    server: Server, run_dir: Path, capacity: int = 1000, flush_s: float = 10.0, world_size: int = 1
) -> tuple[BackgroundTracker, list[str]]:
    """A BackgroundTracker for one start of run_dir, as build_sinks makes it; returns it and its messages."""
    jsonl = run_dir / "metrics.jsonl"
    backlog = Backlog(jsonl, jsonl.stat().st_size if jsonl.exists() else 0)
    state = TrackerState(run_dir)
    previous = state.begin_attempt(world_size)
    messages: list[str] = []
    start = StartInfo(
        "test", {"train.lr": 0.1}, {"sys.world_size": str(world_size)}, state.attempt, state.crashed_attempt
    )
    return BackgroundTracker(
        MemoryTracker(server), state, start, previous, messages.append, capacity, flush_s, backlog
    ), messages


def log(run_dir: Path, sink: BackgroundTracker, record: dict[str, object]) -> None:
    """What MetricsWriter does: metrics.jsonl first, then the sink."""
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    sink.write(record)


def train(step: int) -> dict[str, object]:
    return {"kind": "train", "time": 1.0, "step": step, "loss": 1.0 / step, "world_size": 1}


def event(name: str, step: int, **fields: object) -> dict[str, object]:
    return {"kind": "event", "time": 1.0, "event": name, "step": step, **fields}


def loss_steps(server: Server, run_id: str) -> list[int]:
    return [step for key, step, _ in server.history[run_id] if key == "train/loss"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12), st.booleans()), min_size=1, max_size=4))
def test_steps_never_go_back_across_kills_and_resumes(
    tmp_path_factory: pytest.TempPathFactory, attempts: list[tuple[int, int, bool]]
) -> None:
    """Attempts that train to some step, get killed (some before delivering), resume from a checkpoint:
    the tracker's history is each step once, in order, and holds every step trained up to the last."""
    run_dir = tmp_path_factory.mktemp("run")
    server = Server()
    resume_at, trained_to = 0, 0
    for kill_at, checkpoint_back, delivers in attempts:
        sink, _ = attempt(server, run_dir, flush_s=10.0 if delivers else 0.0)
        sink.tracker.killed = not delivers  # type: ignore[attr-defined]  # killed before anything was sent
        log(run_dir, sink, event("resume" if resume_at else "start", resume_at, world_size=1))
        last = resume_at + kill_at
        for step in range(resume_at + 1, last + 1):
            log(run_dir, sink, train(step))
        sink.close("failed")
        trained_to = max(trained_to, last)
        resume_at = max(0, last - checkpoint_back)  # the newest checkpoint at or before the kill
        resume_at = min(resume_at, last)
    sink, _ = attempt(server, run_dir)  # a last attempt that finishes
    log(run_dir, sink, event("resume" if resume_at else "start", resume_at, world_size=1))
    for step in range(resume_at + 1, trained_to + 2):
        log(run_dir, sink, train(step))
    sink.close("completed")
    run_ids = list(server.history)
    assert len(run_ids) == 1, run_ids  # one run across every restart
    assert loss_steps(server, run_ids[0]) == list(range(1, trained_to + 2))


def test_a_down_tracker_never_blocks_and_close_is_bounded(tmp_path: Path) -> None:
    server = Server()
    server.down.set()
    sink, messages = attempt(server, tmp_path, capacity=10, flush_s=1.0)
    log(tmp_path, sink, event("start", 0, world_size=1))
    for step in range(1, 101):
        log(tmp_path, sink, train(step))  # returns at once: the queue keeps the newest 10
    sink.close("completed")
    assert not sink._thread.is_alive()  # the delivery thread stopped at the flush deadline, not the retry schedule
    assert sum("retrying every" in m for m in messages) == 1, messages
    assert any("gave up after log.tracker_flush_s=1s" in m for m in messages), messages
    assert sink.dropped == 101 - 10  # 101 records queued, the newest 10 kept


def test_outage_delivers_the_newest_records_and_counts_the_rest(tmp_path: Path) -> None:
    server = Server()
    sink, messages = attempt(server, tmp_path, capacity=5)
    log(tmp_path, sink, event("start", 0, world_size=1))
    log(tmp_path, sink, train(1))
    deadline = time.monotonic() + 30
    while loss_steps(server, "run0") != [1] if "run0" in server.history else True:
        assert time.monotonic() < deadline, "step 1 never delivered"
        time.sleep(0.01)
    server.down.set()
    for step in range(2, 21):
        log(tmp_path, sink, train(step))
    while not any("retrying every" in m for m in messages):  # a delivery failed: the outage was seen
        time.sleep(0.01)
    server.down.clear()
    sink.close("completed")
    steps = loss_steps(server, "run0")
    assert steps == sorted(set(steps)) and steps[-5:] == [16, 17, 18, 19, 20], steps
    back = [m for m in messages if "reachable again" in m]
    dropped = sum(int(m.split(" record(s) were dropped")[0].rsplit(" ", 1)[1]) for m in messages if "were dropped" in m)
    assert len(back) == 1 and len(steps) + dropped == 20, messages
    assert server.status["run0"] == "completed" and server.tags["run0"]["ddptrain.status"] == "completed"


def test_resume_tags_name_the_attempt_and_the_world_size_change(tmp_path: Path) -> None:
    server = Server()
    first, _ = attempt(server, tmp_path, world_size=2)
    log(tmp_path, first, event("start", 0, world_size=2))
    log(tmp_path, first, event("preempted", 3, signal="SIGTERM", world_size=2))
    first.close("preempted")
    second, _ = attempt(server, tmp_path, world_size=1)
    log(tmp_path, second, event("resume", 3, world_size=1, restart_count=0, host="h"))
    second.close("completed")
    tags = server.tags["run0"]
    assert tags["ddptrain.preempted.1"] == "step 3 (SIGTERM)"
    assert tags["ddptrain.attempt.2"] == "resume at step 3, world size 1, restart count 0, host h"
    assert tags["ddptrain.world_size_change.2"] == "2 -> 1 at step 3"
    assert json.loads((tmp_path / "trackers.json").read_text())["attempts"] == 2


def test_each_attempt_s_ending_is_tagged_and_a_kill_is_named_at_the_next_start(tmp_path: Path) -> None:
    server = Server()
    first, _ = attempt(server, tmp_path)
    log(tmp_path, first, event("start", 0, world_size=1))
    log(tmp_path, first, train(1))
    log(tmp_path, first, event("interrupted", 1, signal="SIGINT", exit_code=130, world_size=1))
    first.close("interrupted")
    assert server.status["run0"] == "interrupted"
    second, _ = attempt(server, tmp_path)
    log(tmp_path, second, event("resume", 1, world_size=1))
    log(tmp_path, second, train(2))
    # SIGKILL: nothing more reaches the server and close() never runs; only the delivery thread is let go.
    second.tracker.killed = True  # type: ignore[attr-defined]
    second._deadline = 0.0
    second._closing.set()
    second._thread.join(10)
    third, _ = attempt(server, tmp_path)
    log(tmp_path, third, event("resume", 1, world_size=1))
    log(tmp_path, third, train(2))
    log(tmp_path, third, event("completed", 2, exit_code=0))
    third.close("completed")
    tags = server.tags["run0"]
    assert tags["ddptrain.ending.1"] == "interrupted by SIGINT at step 1, checkpoint committed (exit 130)"
    assert tags["ddptrain.ending.2"].startswith("crashed: no end record (killed (SIGKILL, out of memory)")
    assert tags["ddptrain.ending.3"] == "completed at step 2 (exit 0)"
    assert tags["ddptrain.status"] == "completed" and server.status["run0"] == "completed"
    assert not [key for key, _, _ in server.history["run0"] if key.startswith(("event/interrupted", "event/completed"))]
    assert "open_attempt" not in json.loads((tmp_path / "trackers.json").read_text())


def test_a_missing_tracker_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what find_spec reports for an absent package
    with pytest.raises(ConfigError, match=r"pip install 'ddptrain\[mlflow\]'"):
        require_packages(load_config(None, ["log.trackers=[mlflow]"]).log)


def test_config_of_trackers() -> None:
    assert tracker_names(load_config(None, ["log.tensorboard=true", "log.trackers=[mlflow]"]).log) == [
        "tensorboard",
        "mlflow",
    ]
    with pytest.raises(ConfigError, match="log.track_artifacts needs one of mlflow, wandb in log.trackers"):
        load_config(None, ["log.track_artifacts=[model]"])
    with pytest.raises(ConfigError, match="log.trackers.0"):
        load_config(None, ["log.trackers=[neptune]"])
    assert flatten({"train": {"lr": 0.1, "betas": [0.9, 0.95]}, "model": {"kwargs": {}}}) == {
        "train.lr": 0.1,
        "train.betas": [0.9, 0.95],
        "model.kwargs": {},
    }


def test_every_registered_tracker_builds_from_its_module() -> None:
    """A tracker is its module plus one line in TRACKERS: each registered `build` is importable."""
    from ddptrain.config.kinds import TRACKERS

    assert all(callable(TRACKERS.load(name)) for name in TRACKERS)


def test_the_csv_tracker_writes_every_logged_value_into_the_run_folder(tiny_args: list[str], tmp_path: Path) -> None:
    """log.trackers=[csv]: run.dir/metrics.csv holds each train value metrics.jsonl holds, one row each, and the
    attempt's end; a resumed run appends to it under the one header."""
    from ddptrain.cli import main

    run_dir = tmp_path / "run"
    assert main(["train", *tiny_args, "log.trackers=[csv]", "train.max_steps=3"]) == 0
    assert main(["train", *tiny_args, "log.trackers=[csv]", "train.max_steps=6"]) == 0  # resumes at step 3
    with (run_dir / "metrics.csv").open(newline="") as f:
        header, *rows = list(csv.reader(f))
    assert header == ["step", "time", "series", "metric", "value"] and header not in rows
    losses = {(int(r[0]), float(r[4])) for r in rows if r[2:4] == ["train", "loss"]}
    assert losses == {(r["step"], r["loss"]) for r in read_metrics(run_dir)} and len(losses) == 6
    assert [int(r[0]) for r in rows if r[2:4] == ["end", "completed"]] == [3, 6]


def test_mlflow_without_a_uri_records_into_the_run_folder_never_the_working_directory(
    tiny_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's own default store is ./mlflow.db (and ./mlruns for artifacts): ddptrain's is the run folder."""
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'ddptrain[mlflow]')")
    from mlflow.tracking import MlflowClient

    from ddptrain.cli import main

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    work, run_dir = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    monkeypatch.chdir(work)
    # The model is the cheaper artifact to make (the report draws plots: ~0.6 CPU-s); both uploads reaching a
    # server are tests/dist/test_trackers_mlflow.py's.
    assert main(["train", *tiny_args, "log.trackers=[mlflow]", "log.track_artifacts=[model]"]) == 0
    assert list(work.iterdir()) == []
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ddptrain").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 7))
    assert run.info.artifact_uri.startswith((run_dir / "mlartifacts").as_uri())
    assert any((run_dir / "mlartifacts").rglob("model.safetensors"))


def test_an_mlflow_file_store_is_refused_at_start_naming_sqlite(
    tiny_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MLflow 3 refuses its file store: the run would record nothing and wait for the tracker at its end."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        if int(version("mlflow").split(".")[0]) < 3:
            pytest.skip("MLflow 2 records to a file store")
    except PackageNotFoundError:
        pytest.skip("the mlflow extra is not installed (pip install 'ddptrain[mlflow]')")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"  # tiny_args' run.dir
    store = (tmp_path / "mlruns").as_uri()
    line = one_line_exit_2(["train", *tiny_args, "log.trackers=[mlflow]", f"log.mlflow.tracking_uri={store}"], capsys)
    assert f"log.mlflow.tracking_uri='{store}' is a file store" in line and "sqlite:///" in line
    assert not (tmp_path / "mlruns").exists() and not (run_dir / "config.yaml").exists()  # refused at start
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "./mlruns")  # a plain path is a file store too
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI='./mlruns' is a file store"):
        require_packages(load_config(None, ["log.trackers=[mlflow]"]).log)
    require_packages(load_config(None, ["log.trackers=[mlflow]", "log.mlflow.tracking_uri=sqlite:///m.db"]).log)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own opt-in: then it records there
    require_packages(load_config(None, ["log.trackers=[mlflow]"]).log)


def test_the_csv_tracker_never_writes_through_a_link_planted_in_the_run_folder(tmp_path: Path) -> None:
    """metrics.csv as a symbolic link to a file outside the run folder: refused, the target unchanged."""
    from ddptrain.observe.trackers.csv_sink import FILE, CsvSink

    outside = tmp_path / "outside.txt"
    outside.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / FILE).symlink_to(outside)
    with pytest.raises(OSError):
        CsvSink(run_dir / FILE)
    assert outside.read_text() == "keep me\n"
