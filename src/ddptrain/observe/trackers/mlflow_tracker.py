"""MLflow: one MLflow run per run folder, through MlflowClient (no global "active run" state).

Params are the flattened resolved config (MLflow params cannot change: on a resume with a changed
value the change is kept as a tag `ddptrain.config_changed.<key>`). The highest delivered step per
series travels in the same log_batch as the metrics (tag `ddptrain.delivered`), so a resumed run
knows what the server holds even when the process was killed right after a delivery.

A run is created with the tag `ddptrain.run_key` (a key stored in run.dir/trackers.json before), and
its id is stored the moment it exists, before params or metrics: a start killed in between leaves a
key but no id, and the next start finds the run by its key instead of opening a second one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ddptrain.config import Config
from ddptrain.errors import ConfigError
from ddptrain.observe.trackers.base import Opened, StartInfo, Update
from ddptrain.observe.trackers.state import TrackerState

# Without log.mlflow.tracking_uri or MLFLOW_TRACKING_URI: a store in the run folder, its artifacts beside it, and
# an experiment of ours (MLflow's "Default" experiment keeps its artifacts in the working directory).
STORE, ARTIFACTS, OWN_EXPERIMENT = "mlflow.db", "mlartifacts", "ddptrain"


def refuse_file_store(options_uri: str | None) -> None:
    """ConfigError (exit 2, one line, before anything is written) when the tracking URI is a file store, which
    MLflow 3 keeps in maintenance mode and refuses: every delivery would fail, the run would record nothing and
    wait for the tracker at its end. Unless MLFLOW_ALLOW_FILE_STORE opts in (MLflow then accepts it)."""
    uri = options_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true", "yes"):
        return
    scheme = urlparse(uri).scheme
    if scheme not in ("", "file") or _mlflow_major() < 3:
        return
    where = f"log.mlflow.tracking_uri={uri!r}" if options_uri else f"MLFLOW_TRACKING_URI={uri!r}"
    raise ConfigError(
        f"{where} is a file store, which MLflow 3 keeps in maintenance mode and refuses (nothing would be "
        "recorded); use a database store such as sqlite:///path/to/mlflow.db or a tracking server (or leave it "
        "unset: the run folder's own sqlite store), or set MLFLOW_ALLOW_FILE_STORE=true to use it anyway"
    )


def _mlflow_major() -> int:
    """The installed MLflow's major version (0 when it cannot be told)."""
    try:
        return int(version("mlflow").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def build(cfg: Config, state: TrackerState | None) -> MLflowTracker:
    """The MLflow tracker of a run (options: log.mlflow): one MLflow run per run folder, its id kept in state."""
    assert state is not None  # a remote tracker always has the run folder's tracker state
    key, known = state.run_key("mlflow")  # stored before MLflow is called: see state.py
    options = cfg.log.mlflow
    uri, experiment, artifacts = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"), options.experiment, None
    if not uri:  # the run folder's own store, never the working directory (MLflow's default: ./mlflow.db, ./mlruns)
        folder = cfg.run_dir.resolve()
        uri, artifacts = f"sqlite:///{folder / STORE}", (folder / ARTIFACTS).as_uri()
        experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or OWN_EXPERIMENT
    return MLflowTracker(uri, experiment, key, known, lambda run_id: state.set_run_id("mlflow", run_id), artifacts)


# A run's terminal MLflow status for each way an attempt ends (observe/endings.py; "failed": it
# never started training). A resume sets the run RUNNING again.
STATUS = {
    "completed": "FINISHED",
    "finished_early": "FINISHED",
    "interrupted": "KILLED",
    "preempted": "KILLED",
    "stopped": "FAILED",
    "crashed": "FAILED",
    "failed": "FAILED",
}
MAX_METRICS, MAX_TAGS = 1000, 100  # MLflow's per-log_batch limits
DELIVERED_TAG = "ddptrain.delivered"
KEY_TAG = "ddptrain.run_key"


class MLflowTracker:
    """Sends to the MLflow tracking server (or store) at tracking_uri."""

    name = "mlflow"

    def __init__(
        self,
        tracking_uri: str,
        experiment: str | None,
        key: str,
        key_known: bool,
        store_id: Callable[[str], None],
        artifacts: str | None = None,
    ) -> None:
        """key: the run folder's creation key (state.py); key_known: an earlier start stored it (and may have
        created a run with it); store_id: records a created run's id in run.dir/trackers.json; artifacts: where
        an experiment this creates keeps its artifacts (None: the store's default)."""
        self.tracking_uri, self.experiment, self.artifacts = tracking_uri, experiment, artifacts
        self.key, self.key_known, self.store_id = key, key_known, store_id
        # The delivery thread retries on its own schedule: MLflow's own retries (7, with backoff,
        # minutes in all) and 120 s timeout would only hide an outage from it. The user's settings win.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self._client: Any = None
        self.run_id = ""

    def open(self, run_id: str | None, start: StartInfo) -> Opened:
        """Create the run in the experiment, or continue run_id (or MLFLOW_RUN_ID at the first start)."""
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = self._client = self._client or MlflowClient(tracking_uri=self.tracking_uri)
        run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or self._created_before(client)
        tags = {**start.system, "mlflow.source.name": "ddptrain", "ddptrain.attempts": str(start.attempt)}
        if "sys.git_commit" in start.system:
            tags["mlflow.source.git.commit"] = start.system["sys.git_commit"]  # the UI shows it with the run
        delivered: dict[str, int] = {}
        notes: list[str] = []
        wanted = {k: str(v) for k, v in start.params.items()}  # MLflow params are text
        if run_id is None:
            experiment_id = self._experiment_id(client)
            if start.attempt > 1 and not self.key_known:
                notes = self._orphans(client, experiment_id, start.run_name)
            run = client.create_run(experiment_id, run_name=start.run_name, tags={KEY_TAG: self.key})
            self.store_id(run.info.run_id)  # before anything is sent: a kill from here on cannot split the run
            params = wanted
        else:
            run = client.get_run(run_id)
            client.update_run(run_id, status="RUNNING")
            delivered = {k: int(v) for k, v in json.loads(run.data.tags.get(DELIVERED_TAG, "{}")).items()}
            held = run.data.params
            params = {k: v for k, v in wanted.items() if k not in held}
            tags.update(
                {
                    f"ddptrain.config_changed.{k}": f"{held[k]} -> {v} (attempt {start.attempt})"
                    for k, v in wanted.items()
                    if k in held and held[k] != v
                }
            )
        self.run_id = run.info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), MAX_TAGS):
            client.log_batch(self.run_id, params=items[i : i + MAX_TAGS])
        self._log_tags(tags)
        return Opened(self.run_id, delivered, notes)

    def _created_before(self, client: Any) -> str | None:
        """The run an earlier start created with this folder's key but was killed before storing its id."""
        if not self.key_known:
            return None  # the key is new: no run can carry it
        found = client.search_runs(
            [self._experiment_id(client)], filter_string=f"tags.`{KEY_TAG}` = '{self.key}'", max_results=1
        )
        return str(found[0].info.run_id) if found else None

    def _orphans(self, client: Any, experiment_id: str, name: str) -> list[str]:
        """A note naming runs of this name that an earlier version may have left RUNNING (killed before it
        recorded their id): they have no creation key. Only named: they may belong to a live run elsewhere."""
        if "'" in name:
            return []  # not expressible in a filter string without escaping rules MLflow does not document
        query = f"attributes.run_name = '{name}' and attributes.status = 'RUNNING' and tags.`mlflow.source.name` = 'ddptrain'"
        runs = [r for r in client.search_runs([experiment_id], filter_string=query) if KEY_TAG not in r.data.tags]
        if not runs:
            return []
        ids = ", ".join(r.info.run_id for r in runs)
        return [
            f"run(s) {ids} named {name!r} are RUNNING without a creation key: an earlier ddptrain may have left them "
            "when an attempt was killed before it recorded their id; if no other job uses them, close them "
            "(docs/observability.md, 'Tracker runs left open')"
        ]

    def send(self, update: Update) -> None:
        """Metrics in log_batch calls of at most 1,000; the delivered marks go in the call with the last ones."""
        from mlflow.entities import Metric, RunTag

        metrics = [Metric(p.key, p.value, int(p.time * 1000), p.step) for p in update.points]
        tags = {
            DELIVERED_TAG: json.dumps(update.delivered, sort_keys=True),
            **update.tags,
            **{f"ddptrain.label.{label}": "true" for label in update.labels},
        }
        tag_items = [RunTag(k, v) for k, v in tags.items()]
        while len(metrics) > MAX_METRICS:
            self._client.log_batch(self.run_id, metrics=metrics[:MAX_METRICS])
            metrics = metrics[MAX_METRICS:]
        self._client.log_batch(self.run_id, metrics=metrics, tags=tag_items[:MAX_TAGS])
        for i in range(MAX_TAGS, len(tag_items), MAX_TAGS):
            self._client.log_batch(self.run_id, tags=tag_items[i : i + MAX_TAGS])

    def upload(self, folder: Path, kind: str) -> None:
        """The folder's files under the run's artifacts, in a folder named after their kind."""
        self._client.log_artifacts(self.run_id, str(folder), artifact_path=kind)

    def finish(self, status: str) -> None:
        """FINISHED (completed), KILLED (interrupted, preempted: a resume sets it RUNNING again) or FAILED."""
        self._client.set_terminated(self.run_id, STATUS.get(status, "FAILED"), int(time.time() * 1000))

    def _log_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, v) for k, v in tags.items()]
        for i in range(0, len(items), MAX_TAGS):
            self._client.log_batch(self.run_id, tags=items[i : i + MAX_TAGS])

    def _experiment_id(self, client: Any) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"  # MLflow's "Default" experiment
        found = client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(client.create_experiment(name, artifact_location=self.artifacts))
        except Exception:  # created meanwhile by another run: use that one
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)
