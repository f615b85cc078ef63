"""The training loop sections: train (steps, batch, precision), optim and schedule."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from ddptrain.config.base import LineText, Section
from ddptrain.config.kinds import DEFAULT_SCHEDULE, SCHEDULES
from ddptrain.errors import ConfigError

# A metric name every tracker takes as it is (MLflow, TensorBoard, W&B) and a Python identifier's shape.
METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


class EarlyStopConfig(Section):
    metric: str = Field(
        "val_loss",
        description="What each evaluation is judged by: val_loss, or val_<name> for a metric of your own (an extra scalar of the model's output dict or of train.metrics); a val_<name> no evaluation records stops the run at the first evaluation (exit 2).",
    )
    patience: int = Field(3, ge=1, description="Stop after this many evaluations in a row without an improvement.")
    min_delta: float = Field(
        0.0, ge=0, description="An improvement is a change beyond the best value by more than this."
    )
    mode: Literal["min", "max"] = Field("min", description="min: lower is better (a loss); max: higher is better.")

    @field_validator("metric")
    @classmethod
    def _logged_at_evaluations(cls, value: str) -> str:
        name = value.removeprefix("val_")
        if not value.startswith("val_") or not METRIC_NAME.fullmatch(name):
            raise ValueError(
                f"{value!r} is never logged at an evaluation: use val_loss or val_<name> for a metric of your own "
                "(e.g. val_accuracy)"
            )
        return value


INT8_CHUNK = 2048  # values per fp32 scale when train.diloco.outer_dtype=int8 (train/sync/outer_dtype.py encodes them)


def outer_payload_bytes(numel: int, dtype: str) -> int:
    """Bytes of one rank's pseudo-gradient of `numel` values on the wire in train.diloco.outer_dtype `dtype` (int8:
    a byte a value and 4 per INT8_CHUNK values; bf16: 2 a value; fp32: 4)."""
    if dtype == "int8":
        return numel + 4 * -(-numel // INT8_CHUNK)
    return numel * (2 if dtype == "bf16" else 4)


class DiLoCoConfig(Section):
    every_steps: int = Field(
        0,
        ge=0,
        description="H: inner steps between two outer syncs (DiLoCo, docs/slow-links.md#diloco); every H-th step and the last one sync the groups' weights; 0 turns DiLoCo off.",
    )
    outer_lr: float = Field(
        0.7,
        gt=0,
        le=10,
        description="The outer SGD's learning rate on the groups' mean pseudo-gradient (1.0 with momentum 0: plain averaging of the groups' weights).",
    )
    outer_momentum: float = Field(
        0.3,
        ge=0,
        lt=1,
        description="The outer SGD's Nesterov momentum; 0: none. 0.3 with outer_lr 0.7 came out best on runs of a few hundred steps (the 3.2M GPT, 400 steps, 3 seeds); the papers' 0.9 suits thousands (docs/slow-links.md#diloco).",
    )
    groups: int = Field(
        0,
        ge=0,
        description="DiLoCo groups, each training with DDP (or, dist.strategy=fsdp, FSDP) over its own ranks: 0 is one group per node (torchrun's LOCAL_WORLD_SIZE ranks), N splits the world into N groups of consecutive ranks (N must divide the world size).",
    )
    outer_dtype: Literal["fp32", "bf16", "int8"] = Field(
        "fp32",
        description=f"The dtype the pseudo-gradients cross the groups in: fp32 (an all-reduce, 4 bytes a value), bf16 (2 bytes) or int8 (1 byte and one fp32 scale per {INT8_CHUNK} values), both all-gathered and averaged in group order on every rank (docs/slow-links.md#diloco).",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="P: the trainable parameters in P contiguous fragments balanced by size, synced in turn H/P steps apart (each outer sync sends ~1/P of the bytes; the last step syncs all); at most every_steps and the count of trainable parameter tensors.",
    )
    delay_steps: int = Field(
        0,
        ge=0,
        description="tau: inner steps each outer sync overlaps (streaming DiLoCo): a fragment's exchange starts at its sync step and its outer step is applied tau steps later (the fragment's weights then replaced by the global ones); below every_steps // fragments; 0: applied at once. The last step applies every sync with no delay (docs/slow-links.md#overlapping-a-sync-with-inner-steps-delay_steps).",
    )

    @property
    def on(self) -> bool:
        """Whether DiLoCo trains this run."""
        return self.every_steps > 0

    def group_count(self, world_size: int, local_world_size: int) -> int:
        """How many groups the world trains in (ConfigError when they cannot be of equal size)."""
        per = (
            f"train.diloco.groups={self.groups}"
            if self.groups
            else f"groups=0 (one per node): {local_world_size} ranks per node"
        )
        groups = self.groups or world_size // max(local_world_size, 1)
        if not groups or world_size % groups or (not self.groups and world_size % local_world_size):
            raise ConfigError(f"{per} does not divide the world size {world_size}: DiLoCo needs groups of equal size")
        return groups


class TrainConfig(Section):
    max_steps: int = Field(300, ge=1, description="Optimizer steps to train for.")
    global_batch_size: int = Field(
        32, ge=1, description="Samples per optimizer step across all ranks; accumulation = global / (micro x world)."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Autocast dtype; fp16 adds a GradScaler.")
    lr: float = Field(3e-3, gt=0, le=10, description="Peak learning rate (of every optimizer; the schedule scales it).")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Where the decay of schedule.name ends, as a fraction of lr."
    )
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps before the schedule's shape (schedule.name).")
    weight_decay: float = Field(0.1, ge=0, le=10, description="AdamW weight decay (applied to matrices only).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this value; 0 disables.")
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    activation_checkpointing: Literal["none", "full", "every_n"] = Field(
        "none",
        description="full: recompute each shard unit's activations in backward instead of keeping them (less memory, ~1/3 more compute); every_n: only every activation_checkpointing_every-th unit (1st, n+1-th, ...).",
    )
    activation_checkpointing_every: int = Field(
        2, ge=1, description="activation_checkpointing=every_n: checkpoint one shard unit in this many."
    )
    eval_every: int = Field(100, ge=0, description="Evaluate every N steps (and at the end); 0 disables.")
    eval_batches: int = Field(
        8,
        ge=1,
        description="Global batches per evaluation: the first eval_batches x global_batch_size validation samples (all when fewer), the same samples at any world size; val_loss is their mean.",
    )
    metrics: LineText | None = Field(
        None,
        description="'pkg.module:fn' called as fn(outputs, batch) on every micro-batch (training and evaluation) and returning a dict of 0-dim tensors: metrics of your own, beside the 0-dim tensors of a model's output dict.",
    )
    early_stop: EarlyStopConfig | None = Field(
        None,
        description="Stop when an evaluation metric stops improving: {metric, patience, min_delta, mode}; the best checkpoint is kept (checkpoints/best.json). None: train to max_steps.",
    )
    diloco: DiLoCoConfig | None = Field(
        None,
        description="Train in DiLoCo groups that synchronize their weights every few steps instead of their gradients every step: {every_steps, outer_lr, outer_momentum, groups, outer_dtype, fragments, delay_steps} (docs/slow-links.md#diloco). None: every step all-reduces the gradients.",
    )
    on_nonfinite: Literal["skip", "stop"] = Field(
        "skip",
        description="When the (all-reduced) gradient is NaN/inf: skip the step on every rank (decided on the device), or stop every rank at the next logged step.",
    )

    @model_validator(mode="after")
    def _early_stop_has_evaluations(self) -> TrainConfig:
        if self.early_stop is not None and self.eval_every == 0:
            raise ValueError("train.early_stop judges evaluations: set train.eval_every above 0")
        return self

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_list(cls, value: Any) -> Any:
        # YAML has no tuples: a two-item list is the natural spelling (strict mode wants a tuple).
        return tuple(value) if isinstance(value, list) else value

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each AdamW beta must be in [0, 1), got {list(value)}")
        return value


class OptimConfig(Section):
    target: str | None = Field(
        None,
        description="'pkg.module:factory' called as factory(param_groups, **kwargs) and returning a torch Optimizer; None uses AdamW (fused on CUDA and CPU) with train.lr, train.betas, train.weight_decay.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the optimizer factory given by target (each parameter group already carries lr and weight_decay).",
    )


class ScheduleConfig(Section):
    name: Annotated[str, AfterValidator(SCHEDULES.check)] = Field(
        DEFAULT_SCHEDULE,
        description=f"Learning-rate shape after train.warmup_steps of linear warm-up: {SCHEDULES.explained()}.",
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: share of train.max_steps spent in the final decay."
    )
    target: str | None = Field(
        None,
        description="'pkg.module:factory' called as factory(optimizer, max_steps=..., **kwargs) and returning a torch LRScheduler stepped once per optimizer step; overrides name.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the schedule factory given by target."
    )
