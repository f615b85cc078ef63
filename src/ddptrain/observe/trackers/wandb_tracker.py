"""Weights & Biases: one W&B run per run folder, continued with `resume="allow"` and the stored id.

ddptrain chooses the run id and stores it in run.dir/trackers.json before calling wandb.init, so a
process killed during init still continues the same run next time. W&B steps are ddptrain's
optimizer steps; tags (key -> text) go into the run's summary, labels into its tags.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddptrain.config import Config
from ddptrain.observe.trackers.base import Opened, StartInfo, Update
from ddptrain.observe.trackers.state import TrackerState


def build(cfg: Config, state: TrackerState | None) -> WandbTracker:
    """The W&B tracker of a run (options: log.wandb): one W&B run per run folder, its id kept in state."""
    assert state is not None  # a remote tracker always has the run folder's tracker state
    options = cfg.log.wandb
    return WandbTracker(
        options.project,
        options.entity,
        options.mode,
        cfg.run_dir,
        lambda run_id: state.set_run_id("wandb", run_id),
    )


# The exit code each way an attempt ends (observe/endings.py) means; the run's summary has the details.
EXIT_CODE = {
    "completed": 0,
    "finished_early": 0,
    "interrupted": 130,
    "preempted": 75,
    "stopped": 1,
    "crashed": 1,
    "failed": 1,
}


class WandbTracker:
    """Sends to W&B; project, entity and mode None fall back to WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE."""

    name = "wandb"

    def __init__(
        self, project: str | None, entity: str | None, mode: str | None, run_dir: Path, store_id: Callable[[str], None]
    ) -> None:
        self.project, self.entity, self.mode = project, entity, mode
        self.run_dir = run_dir
        self.store_id = store_id
        self._run: Any = None

    def open(self, run_id: str | None, start: StartInfo) -> Opened:
        """wandb.init with the stored id (or WANDB_RUN_ID, or a new one, stored first) and resume="allow"."""
        import wandb

        if run_id is None:
            run_id = os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:16]
            self.store_id(run_id)  # before init: a kill inside init must not lead to a second run
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            id=run_id,
            resume="allow",
            mode=self.mode,  # type: ignore[arg-type]  # a str from the config's Literal
            name=start.run_name,
            config=start.params,
            allow_val_change=True,
            dir=None if os.environ.get("WANDB_DIR") else str(self.run_dir),
            # ddptrain's own output already goes to run.dir/logs; W&B capturing stdout would wrap the progress bar.
            settings=wandb.Settings(console="off"),
        )
        self._run.summary.update(start.system)
        return Opened(run_id)

    def send(self, update: Update) -> None:
        """One wandb.log per step, in step order; tags into the summary, labels into run.tags."""
        by_step: dict[int, dict[str, float]] = {}
        for p in update.points:
            by_step.setdefault(p.step, {})[p.key] = p.value
        for step in sorted(by_step):
            self._run.log(by_step[step], step=step)
        if update.tags:
            self._run.summary.update(update.tags)
        if update.labels:
            self._run.tags = tuple(sorted({*self._run.tags, *update.labels}))

    def upload(self, folder: Path, kind: str) -> None:
        """The model folder as a W&B artifact of type "model"; report files into the run's files."""
        import wandb

        if kind == "model":
            artifact = wandb.Artifact(f"{self._run.name or self._run.id}-model".replace("/", "-"), type="model")
            artifact.add_dir(str(folder))
            self._run.log_artifact(artifact)
        else:
            for path in sorted(folder.iterdir()):
                self._run.save(str(path), base_path=str(folder.parent), policy="now")

    def finish(self, status: str) -> None:
        """End the run with the exit code ddptrain's command ends with."""
        self._run.finish(exit_code=EXIT_CODE.get(status, 1))
