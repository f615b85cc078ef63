"""Experiment trackers fed by MetricsWriter: TensorBoard, MLflow, Weights & Biases, CSV.

Each tracker is its module here, with `build(cfg, state)`, plus its line in config/kinds.py's
TRACKERS (its name, its package and extra, local or remote). `build_sinks` (called by
run.build_run, step 7) returns the sinks `log.trackers` asks for, on rank 0 only. Local ones
(TensorBoard, CSV) write files in the training thread; remote ones (MLflow, W&B) run behind a
BackgroundTracker each (background.py): a bounded queue and a thread,
so that a slow or unreachable tracker never blocks or fails training. run.dir/trackers.json
(state.py) keeps one tracker run per run folder across restarts, recorded before anything is sent.
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from ddptrain.config import Config, LogConfig
from ddptrain.config.kinds import TRACKERS
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError
from ddptrain.observe.trackers.background import BackgroundTracker, Backlog
from ddptrain.observe.trackers.base import Sink, StartInfo, flatten
from ddptrain.observe.trackers.mlflow_tracker import refuse_file_store
from ddptrain.observe.trackers.state import TrackerState
from ddptrain.run_folder import metrics_file


def tracker_names(log: LogConfig) -> list[str]:
    """The trackers the config asks for; `log.tensorboard: true` is the same as listing tensorboard."""
    names: list[str] = list(dict.fromkeys(log.trackers))
    if log.tensorboard and "tensorboard" not in names:
        names.insert(0, "tensorboard")
    return names


def require_packages(log: LogConfig) -> None:
    """Raise ConfigError (exit 2) naming the extra when a requested tracker's package is missing, or naming a
    store the tracker cannot record to (MLflow 3's file store).

    Every rank calls this before any collective, so that all of them stop, not only rank 0.
    """
    names = tracker_names(log)
    for name in names:
        kind = TRACKERS[name]
        if kind.package is not None and importlib.util.find_spec(kind.package) is None:
            how = f"pip install 'ddptrain[{kind.extra}]'" if kind.extra else f"install {kind.package}"
            raise ConfigError(f"log.trackers asks for {name}, but the {kind.package} package is not installed: {how}")
    if "mlflow" in names:
        refuse_file_store(log.mlflow.tracking_uri)


def build_sinks(cfg: Config, ctx: DistContext, say: Callable[[str], None]) -> list[Sink]:
    """The tracker sinks of this rank (none but on rank 0); remote ones start delivering at once."""
    names = tracker_names(cfg.log)
    if not ctx.is_main or not names:
        return []
    sinks: list[Sink] = [_build(name, cfg, None) for name in names if not TRACKERS[name].remote]
    remote = [name for name in names if TRACKERS[name].remote]
    if not remote:
        return sinks
    # ckpt.resume=never retrains from scratch in the same folder: that is a new tracker run too.
    fresh = cfg.ckpt.resume == "never"
    state = TrackerState(cfg.run_dir, fresh=fresh)
    previous_world_size = state.begin_attempt(ctx.world_size)
    start = StartInfo(
        run_name=cfg.log.tracker_run_name or cfg.run.name,
        params=flatten(cfg.model_dump(mode="json", by_alias=True)),
        system=system_info(ctx),
        attempt=state.attempt,
        crashed_attempt=state.crashed_attempt,
    )
    # What earlier attempts wrote before this one appends: a killed attempt may not have sent all of it.
    jsonl = metrics_file(cfg.run_dir)
    backlog_bytes = jsonl.stat().st_size if jsonl.is_file() and not fresh else 0
    for name in remote:
        tracker = _build(name, cfg, state)
        sinks.append(
            BackgroundTracker(
                tracker,
                state,
                start,
                previous_world_size,
                say,
                cfg.log.tracker_buffer,
                cfg.log.tracker_flush_s,
                Backlog(jsonl, backlog_bytes),
            )
        )
    return sinks


def _build(name: str, cfg: Config, state: TrackerState | None) -> Any:
    """The tracker (or sink) `name` for this run; its module is imported here, when it is asked for."""
    return TRACKERS.load(name)(cfg, state)


def system_info(ctx: DistContext) -> dict[str, str]:
    """World size, devices, versions, hosts and the git commit of the working directory (when in a repository)."""
    info = {
        "sys.world_size": str(ctx.world_size),
        "sys.device": str(ctx.device.type),
        "sys.backend": ctx.backend or "none",
        "sys.torch": torch.__version__,
        "sys.python": platform.python_version(),
        "sys.hosts": ",".join(sorted(set(ctx.hosts or (ctx.hostname,)))),
    }
    if ctx.device.type == "cuda":
        info["sys.device_name"] = torch.cuda.get_device_name(ctx.device)
        info["sys.cuda"] = str(torch.version.cuda)
    commit = git_commit()
    if commit:
        info["sys.git_commit"] = commit
    return info


def git_commit() -> str | None:
    """HEAD of the git repository around the working directory, None outside one (or without git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
