"""The training loop sections: train (steps, batch, precision), optim and schedule."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ddptrain.config.base import Section


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
    on_nonfinite: Literal["skip", "stop"] = Field(
        "skip",
        description="When the (all-reduced) gradient is NaN/inf: skip the step on every rank (decided on the device), or stop every rank at the next logged step.",
    )

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
    name: Literal["cosine", "wsd", "linear", "constant"] = Field(
        "cosine",
        description="Learning-rate shape after train.warmup_steps of linear warm-up: cosine or linear decay to train.min_lr_ratio at max_steps, wsd (stable at lr, then a linear decay over the last decay_fraction of the run), or constant.",
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
