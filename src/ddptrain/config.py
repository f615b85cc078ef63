"""Typed run configuration: pydantic models, YAML files and dotted command-line overrides.

Every field carries a description; `ddptrain train --help-config` prints them. Unknown keys are
errors (a typo must never be silently ignored), and every user mistake surfaces as a
`ConfigError`, which the CLI turns into exit code 2 with one message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ddptrain.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class RunConfig(_Section):
    name: str = Field("default", description="Run name; the default output folder is runs/<name>.")
    dir: str | None = Field(None, description="Output folder for config, metrics, logs and checkpoints (default runs/<name>).")
    seed: int = Field(1337, description="Seed for model init, data order and every RNG; each rank derives its own from it.")


class ModelConfig(_Section):
    target: str | None = Field(None, description="'pkg.module:factory' building your own nn.Module; None uses the built-in GPT.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the model factory given by target.")
    n_layer: int = Field(4, ge=1, description="Built-in GPT: transformer blocks.")
    n_head: int = Field(4, ge=1, description="Built-in GPT: attention heads per block.")
    n_embd: int = Field(128, ge=8, description="Built-in GPT: embedding width; must divide by n_head.")
    block_size: int = Field(128, ge=2, description="Built-in GPT: context length in tokens (bytes for the default corpus).")
    vocab_size: int = Field(256, ge=2, description="Built-in GPT: vocabulary size; 256 for the byte-level corpus.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Built-in GPT: dropout probability.")
    bias: bool = Field(False, description="Built-in GPT: biases in Linear and LayerNorm layers.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.target is None and self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        return self


class DataConfig(_Section):
    target: str | None = Field(None, description="'pkg.module:factory' returning (train_dataset, val_dataset); None uses the token corpus in data.dir.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the dataset factory given by target.")
    dir: str = Field("data/stdlib", description="Folder holding the prepared corpus (train.bin, val.bin, meta.json).")
    micro_batch_size: int = Field(16, ge=1, description="Samples per rank per forward pass.")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank (0 loads in the training process).")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="Share of the corpus held out for validation by `ddptrain prepare`.")


class TrainConfig(_Section):
    max_steps: int = Field(300, ge=1, description="Optimizer steps to train for.")
    global_batch_size: int = Field(32, ge=1, description="Samples per optimizer step across all ranks; accumulation = global / (micro x world).")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Autocast dtype; fp16 adds a GradScaler.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of lr.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps before cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (applied to matrices only).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this value; 0 disables.")
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    eval_every: int = Field(100, ge=0, description="Evaluate every N steps (and at the end); 0 disables.")
    eval_batches: int = Field(8, ge=1, description="Micro-batches per rank per evaluation.")
    on_nonfinite: Literal["skip", "stop"] = Field("skip", description="When the (all-reduced) gradient is NaN/inf: skip the step on every rank, or stop.")


class DistConfig(_Section):
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="Process-group backend; auto picks NCCL when CUDA is available, else gloo.")
    timeout_s: float = Field(600.0, gt=0, description="Collective timeout: a rank waiting longer fails instead of hanging.")
    startup_timeout_s: float = Field(900.0, gt=0, description="Timeout for the first collectives while all ranks start up.")
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size; smaller buckets start all-reduce earlier in backward.")
    static_graph: bool = Field(False, description="DDP static_graph: the set of used parameters never changes.")
    gradient_as_bucket_view: bool = Field(True, description="DDP: gradients alias the all-reduce buckets (saves a copy and memory).")
    find_unused_parameters: bool = Field(False, description="DDP: search for parameters without gradients each step (slower).")


class CkptConfig(_Section):
    every_steps: int = Field(100, ge=0, description="Save a checkpoint every N optimizer steps (and at the end); 0 only at the end.")
    keep: int = Field(3, ge=1, description="Committed checkpoints to keep; older ones are deleted after a newer commit.")
    resume: str = Field("auto", description="'auto' continues from the newest good checkpoint in run.dir, 'never' starts fresh, or a checkpoint path.")
    on_error: Literal["stop", "continue"] = Field("stop", description="When a save fails on any rank: stop the run, or warn and keep training.")
    async_save: bool = Field(False, alias="async", description="Write checkpoints in a background thread; the loop only waits for the copy off the device.")
    timeout_s: float = Field(600.0, gt=0, description="How long ranks wait for each other's checkpoint writes before the save fails.")


class LogConfig(_Section):
    every_steps: int = Field(10, ge=1, description="Write a metrics.jsonl line (and a terminal line) every N steps.")
    tensorboard: bool = Field(False, description="Also write TensorBoard event files to run.dir/tensorboard (needs the tensorboard extra).")
    straggler_every: int = Field(50, ge=0, description="Gather per-rank step times every N steps to spot stragglers; 0 disables.")
    straggler_factor: float = Field(1.5, gt=1.0, description="Warn when the slowest rank's step time exceeds the median by this factor.")
    peak_tflops: float | None = Field(None, gt=0, description="Peak dense TFLOP/s per device for MFU, for devices not in the built-in table (None: use the table).")


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    log: LogConfig = Field(default_factory=LogConfig)

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

    def to_yaml(self) -> str:
        """The resolved config as YAML, as written to run.dir/config.yaml."""
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.max_steps=100)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override key {key!r} must be dotted, like train.max_steps")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `a.b.c=value` (value parsed as YAML) into the nested dict."""
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{where}'")
        elif "input" in e and e["type"] not in ("value_error", "missing"):
            lines.append(f"{where}: {e['msg']} (got {e['input']!r})")
        else:
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return "invalid config: " + "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (or the built-in defaults when path is None), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def describe_fields() -> str:
    """Every config key with its type, default and description (for --help-config)."""
    out = []
    for section_name, field in Config.model_fields.items():
        section = field.default_factory()  # type: ignore[misc]
        out.append(f"{section_name}:")
        for name, f in type(section).model_fields.items():
            key = f.alias or name
            out.append(f"  {key} = {getattr(section, name)!r}\n      {f.description}")
    return "\n".join(out)
