"""The options sections of the trackers that have any: log.mlflow and log.wandb (config/kinds.py lists the
trackers themselves).

Each section belongs to its tracker (observe/trackers/<name>_tracker.py reads it and nothing else does);
it sits here, in the config layer, so that a config is checked whole when it is loaded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ddptrain.config.base import LineText, Section


class MLflowOptions(Section):
    tracking_uri: LineText | None = Field(
        None,
        description="MLflow tracking server or store URI (None: MLFLOW_TRACKING_URI, else a store inside the run folder, sqlite:///<run.dir>/mlflow.db, its artifacts in run.dir/mlartifacts).",
    )
    experiment: LineText | None = Field(
        None,
        description="MLflow experiment name, created when missing (None: MLFLOW_EXPERIMENT_NAME or MLFLOW_EXPERIMENT_ID, else 'Default'; 'ddptrain' in the run folder's own store).",
    )


class WandbOptions(Section):
    project: LineText | None = Field(None, description="W&B project (None: WANDB_PROJECT, else W&B's default).")
    entity: LineText | None = Field(
        None, description="W&B entity, a user or team (None: WANDB_ENTITY, else your default entity)."
    )
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (None: WANDB_MODE, else online); offline writes run.dir/wandb for `wandb sync`."
    )
