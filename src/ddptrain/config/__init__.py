"""Typed run configuration: pydantic models, YAML files and dotted command-line overrides.

Every field carries a description; `ddptrain train --help-config` prints them. Unknown keys are
errors (a typo must never be silently ignored), and every user mistake surfaces as a
`ConfigError`, which the CLI turns into exit code 2 with one message.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticSerializationError

from ddptrain.config.base import MAX_SEED, MAX_TIMEOUT_S, LineText, Section
from ddptrain.config.data import DataConfig
from ddptrain.config.kinds import EVERY_STEP
from ddptrain.config.model import AdapterConfig, HFModelConfig, ModelConfig
from ddptrain.config.system import CkptConfig, DistConfig, LogConfig, RunConfig, current_keys
from ddptrain.config.train import OptimConfig, ScheduleConfig, TrainConfig
from ddptrain.config_io import (
    apply_overrides,
    check_bounds,
    check_encoded_size,
    format_validation_error,
    load_yaml,
    read_text_file,
    read_yaml_mapping,
)
from ddptrain.errors import ConfigError

__all__ = [  # the sections stay importable from ddptrain.config, as do these config_io helpers
    "MAX_SEED",
    "MAX_TIMEOUT_S",
    "AdapterConfig",
    "CkptConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "HFModelConfig",
    "LineText",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "ScheduleConfig",
    "Section",
    "TrainConfig",
    "apply_overrides",
    "config_from_mapping",
    "describe_fields",
    "load_config",
    "load_yaml",
    "read_text_file",
    "saved_config",
]


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _sharding_fits(self) -> Config:
        d = self.dist
        if d.strategy == "hsdp" and d.shard_size is None:
            raise ValueError(
                "dist.strategy=hsdp needs dist.shard_size (ranks per shard group, e.g. the ranks of one node)"
            )
        if d.shard_size is not None and d.strategy != "hsdp":
            raise ValueError(f"dist.shard_size applies to dist.strategy=hsdp only (strategy is {d.strategy})")
        if d.strategy != "ddp" and self.train.precision == "fp16":
            # FSDP2 has no sharded GradScaler in this trainer: bf16 needs no loss scaling.
            raise ValueError(f"train.precision=fp16 is not supported with dist.strategy={d.strategy}; use bf16")
        return self

    @model_validator(mode="after")
    def _powersgd_without_loss_scaling(self) -> Config:
        if self.dist.grad_compression == "powersgd" and self.train.precision == "fp16":
            # The error feedback carries scaled gradients from step to step: a new scale, or an overflow that
            # GradScaler skips, would leave it in other units or non-finite for every later step.
            raise ValueError(
                "dist.grad_compression=powersgd cannot carry its error feedback across train.precision=fp16's "
                "changing loss scale; use train.precision=bf16 or fp32"
            )
        return self

    @model_validator(mode="after")
    def _diloco_fits(self) -> Config:
        diloco, d, t = self.train.diloco, self.dist, self.train
        if diloco is None:
            return self
        if not diloco.on and (diloco.outer_dtype != "fp32" or diloco.fragments != 1 or diloco.delay_steps):
            raise ValueError(
                "train.diloco.outer_dtype, fragments and delay_steps shape DiLoCo's outer syncs: set "
                "train.diloco.every_steps above 0"
            )
        if not diloco.on:
            return self
        h, p, tau = diloco.every_steps, diloco.fragments, diloco.delay_steps
        refusals = [
            (d.strategy == "hsdp", "trains each group with DDP or FSDP over its own ranks: dist.strategy=hsdp is not supported with it (its replicas across shard groups are what DiLoCo's groups replace: use fsdp, which shards each group over its ranks)"),
            (d.grad_compression == "powersgd", "sends weights, not gradients, across groups: dist.grad_compression=powersgd is not supported with it (fp16 compresses the all-reduce inside a group)"),
            (self.ckpt.format == "dcp", "saves each rank's own weights beside the global ones: ckpt.format=dcp is not supported with it (use auto or sharded)"),
            (t.eval_every % h != 0, f"evaluates the global weights, which every group holds at an outer sync only: train.eval_every={t.eval_every} must be a multiple of train.diloco.every_steps={h} (or 0)"),
            (p > h, f"staggers its fragments H/P steps apart: train.diloco.fragments={p} must be at most every_steps={h}"),
            (p <= h and tau >= h // p, f"overlaps each fragment's sync with the next delay_steps inner steps, one sync at a time: train.diloco.delay_steps={tau} must be below every_steps // fragments = {h // p}"),
            (p > 1 and 0 < t.eval_every < t.max_steps, f"fragments={p} leave every fragment synced (the global weights evaluation needs) at the last step only: train.eval_every must be 0 or at least train.max_steps"),
            (tau > 0 and 0 < t.eval_every < t.max_steps, f"delay_steps={tau} leaves every group on the global weights at the last step only: train.eval_every must be 0 or at least train.max_steps"),
            (t.on_nonfinite == "stop", "skips a non-finite step in the group that met it; train.on_nonfinite=stop would stop one group alone: use skip"),
        ]  # fmt: skip
        for refused, why in refusals:
            if refused:
                raise ValueError(f"train.diloco {why}")
        return self

    @property
    def sync_kind(self) -> str:
        """How the ranks synchronize (config/kinds.py's SYNCS): DiLoCo when train.diloco.every_steps is set."""
        return "diloco" if self.train.diloco is not None and self.train.diloco.on else EVERY_STEP

    @property
    def saved_strategy(self) -> str:
        """The dist.strategy whose state a checkpoint of this run saves as (what ckpt.format must be able to write):
        DiLoCo's shared state (the global weights, the outer optimizer) is full and the same on every rank, as
        DDP's is, whatever dist.strategy; otherwise dist.strategy."""
        return "ddp" if self.sync_kind == "diloco" else self.dist.strategy

    @property
    def run_dir(self) -> Path:
        """The resolved output folder of this run."""
        return Path(self.run.dir) if self.run.dir else Path("runs") / self.run.name

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step so that the global batch is kept at any world size."""
        per_step = self.data.micro_batch_size * world_size
        if self.train.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.train.global_batch_size} is not divisible by "
                f"data.micro_batch_size={self.data.micro_batch_size} x world size {world_size}; "
                f"pick a global batch that is a multiple of {per_step}"
            )
        return self.train.global_batch_size // per_step

    def check_world_size(self, world_size: int, local_world_size: int | None = None) -> None:
        """Refuse (ConfigError) a world size the batch, the shard groups or the DiLoCo groups cannot split over
        (local_world_size: the ranks of a node, when known: train.diloco.groups=0 makes a group of each node)."""
        self.grad_accum_steps(world_size)
        diloco = self.train.diloco
        if diloco is not None and diloco.on:
            diloco.group_count(world_size, local_world_size or world_size)
        d = self.dist
        if d.strategy == "hsdp" and world_size % (d.shard_size or world_size):
            raise ConfigError(
                f"dist.shard_size={d.shard_size} does not divide the world size {world_size}; "
                "hsdp needs whole shard groups (e.g. the ranks of one node)"
            )

    def to_yaml(self) -> str:
        """The resolved config as YAML, as written to run.dir/config.yaml."""
        # One line per value (no folding) and characters as they are: the size config_io's bounds promise.
        return yaml.safe_dump(
            self.model_dump(mode="json", by_alias=True), sort_keys=False, allow_unicode=True, width=2**30
        )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (or the built-in defaults when path is None), apply dotted overrides, validate."""
    data = read_yaml_mapping(Path(path), "config file") if path is not None else {}
    return config_from_mapping(data, overrides or [])


def config_from_mapping(data: Mapping[str, Any], overrides: list[str] | None = None) -> Config:
    """Validate a mapping of sections (as YAML would give), after applying dotted overrides; ConfigError for
    anything invalid, or past the bounds of config_io (depth, values, text), with or without the overrides."""
    check_bounds(data)  # first: a structure past the bounds is never copied or expanded
    merged = apply_overrides(copy.deepcopy(dict(data)), overrides or [])
    check_bounds(merged)
    try:
        cfg = Config.model_validate(merged)
        check_encoded_size(cfg.model_dump(mode="json", by_alias=True))
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    except (PydanticSerializationError, TypeError, ValueError) as e:  # a Python-API value with no JSON form
        raise ConfigError(f"the config cannot be stored as JSON: {' '.join(str(e).split())[:200]}") from None
    return cfg


def saved_config(data: Mapping[str, Any], overrides: list[str] | None = None) -> Config:
    """A config a run recorded (run.dir/config.yaml, a checkpoint's manifest), perhaps with an earlier version's
    keys: those renamed since are read in their current place; then as config_from_mapping."""
    return config_from_mapping(current_keys(data), overrides)


def describe_fields() -> str:
    """Every config key with its type, default and description (for --help-config); a section's own
    sections (log.mlflow) key by key."""
    out = []
    for section_name, field in Config.model_fields.items():
        section = field.default_factory()  # type: ignore[call-arg,misc]
        out.append(f"{section_name}:")
        out.extend(_described(section))
    return "\n".join(out)


def _described(section: Section, prefix: str = "") -> list[str]:
    out = []
    for name, f in type(section).model_fields.items():
        key, value = prefix + (f.alias or name), getattr(section, name)
        if isinstance(value, Section):
            out.extend(_described(value, f"{key}."))
        else:
            out.append(f"  {key} = {value!r}\n      {f.description}")
    return out
