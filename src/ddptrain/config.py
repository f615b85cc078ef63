"""Typed run configuration: pydantic models, YAML files and dotted command-line overrides.

Every field carries a description; `ddptrain train --help-config` prints them. Unknown keys are
errors (a typo must never be silently ignored), and every user mistake surfaces as a
`ConfigError`, which the CLI turns into exit code 2 with one message.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticSerializationError

from ddptrain.config_io import (
    apply_overrides,
    check_bounds,
    check_encoded_size,
    folder_name,
    format_validation_error,
    load_yaml,
    one_line_text,
    read_text_file,
    read_yaml_mapping,
)
from ddptrain.errors import ConfigError

__all__ = ["apply_overrides", "load_yaml", "read_text_file"]  # kept importable from here

# Bounds that keep values meaningful: timedelta overflows past ~1e9 days, NumPy seeds are 32-bit,
# and a timeout of more than a week is a typo, not a plan.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SEED = 2**32 - 1
# A path or name written into scripts, manifests and logs: one line.
LineText = Annotated[str, AfterValidator(one_line_text)]


class _Section(BaseModel):
    # strict: no silent coercion (`train.max_steps=true` is not 1, "3" is not 3); ints still
    # count as floats. allow_inf_nan=False: a NaN or infinite lr/timeout can never train.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, strict=True, allow_inf_nan=False
    )


class RunConfig(_Section):
    name: Annotated[str, AfterValidator(folder_name)] = Field(
        "default", description="Run name; the default output folder is runs/<name>."
    )
    dir: LineText | None = Field(
        None, description="Output folder for config, metrics, logs and checkpoints (default runs/<name>)."
    )
    seed: int = Field(
        1337,
        ge=0,
        le=MAX_SEED,
        description="Seed for model init, data order and every RNG; each rank derives its own from it.",
    )


class HFModelConfig(_Section):
    config: str | dict[str, Any] | None = Field(
        None,
        description="A local folder holding config.json, or an inline mapping of config fields including model_type (e.g. llama).",
    )
    pretrained: LineText | None = Field(
        None, description="A local folder written by save_pretrained: build the model from it and load its weights."
    )

    @model_validator(mode="after")
    def _one_source(self) -> HFModelConfig:
        if (self.config is None) == (self.pretrained is None):
            raise ValueError("model.hf needs exactly one of config (folder or mapping) and pretrained (folder)")
        if isinstance(self.config, dict) and not isinstance(self.config.get("model_type"), str):
            raise ValueError("model.hf.config as a mapping needs model_type (e.g. llama, gpt2, gpt_neox)")
        return self


class ModelConfig(_Section):
    hf: HFModelConfig | None = Field(
        None,
        description="A Hugging Face transformers causal LM (needs the hf extra); None uses target or the built-in GPT.",
    )
    init_from: LineText | None = Field(
        None,
        description="Start from these weights (a run or checkpoint folder, an exported .safetensors, an HF folder): fresh optimizer, step 0. A run folder's own checkpoints win.",
    )
    target: str | None = Field(
        None, description="'pkg.module:factory' building your own nn.Module; None uses the built-in GPT."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the model factory given by target."
    )
    live: str | None = Field(
        None,
        description="Written by ddptrain.train() when given a live nn.Module (its class): commands that rebuild the model (eval, export --format hf) then need model.target. Leave unset.",
    )
    n_layer: int = Field(4, ge=1, description="Built-in GPT: transformer blocks.")
    n_head: int = Field(4, ge=1, description="Built-in GPT: attention heads per block.")
    n_embd: int = Field(128, ge=8, description="Built-in GPT: embedding width; must divide by n_head.")
    block_size: int = Field(
        128,
        ge=2,
        description="Context length in tokens (bytes for the default corpus); also the sample length for model.hf and data.dir.",
    )
    vocab_size: int = Field(
        256, ge=2, description="Built-in GPT: vocabulary size; when not set, the prepared data's (256 for bytes)."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Built-in GPT: dropout probability.")
    bias: bool = Field(False, description="Built-in GPT: biases in Linear and LayerNorm layers.")
    shard_units: list[str] = Field(
        default_factory=list,
        description="dist.strategy fsdp/hsdp: class names of the submodules sharded as one unit each (e.g. your transformer block); the built-in GPT and HF models need none.",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.target is not None and self.hf is not None:
            raise ValueError("set model.target or model.hf, not both")
        if self.target is None and self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        return self


class DataConfig(_Section):
    target: str | None = Field(
        None,
        description="'pkg.module:factory' returning (train_dataset, val_dataset); None uses the token corpus in data.dir.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the dataset factory given by target."
    )
    collate: LineText | None = Field(
        None,
        description="How samples become a batch: None stacks them (torch's default_collate); 'pad' right-pads variable-length token samples (1-D tensors, or mappings with input_ids) to input_ids, attention_mask and labels (-100 at pads), pad id the corpus tokenizer's end-of-document id, else 0; or 'pkg.module:collate' called with the list of samples.",
    )
    live: str | None = Field(
        None,
        description="Written by ddptrain.train() when given live dataset objects (their classes): eval then needs data.target (or data.live=null and data.dir), export and generate --data-dir. Leave unset.",
    )
    dir: LineText = Field(
        "data/stdlib", description="Folder holding the prepared corpus (train.bin, val.bin, meta.json)."
    )
    micro_batch_size: int = Field(16, ge=1, description="Samples per rank per forward pass.")
    num_workers: int = Field(
        0, ge=0, description="DataLoader worker processes per rank (0 loads in the training process)."
    )
    val_fraction: float = Field(
        0.05, gt=0.0, lt=0.5, description="Share of the corpus held out for validation by `ddptrain prepare`."
    )


class TrainConfig(_Section):
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


class OptimConfig(_Section):
    target: str | None = Field(
        None,
        description="'pkg.module:factory' called as factory(param_groups, **kwargs) and returning a torch Optimizer; None uses AdamW (fused on CUDA and CPU) with train.lr, train.betas, train.weight_decay.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the optimizer factory given by target (each parameter group already carries lr and weight_decay).",
    )


class ScheduleConfig(_Section):
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


class DistConfig(_Section):
    strategy: Literal["ddp", "fsdp", "hsdp"] = Field(
        "ddp",
        description="ddp: a full replica per rank; fsdp: parameters, gradients and optimizer state sharded over all ranks; hsdp: sharded within groups of shard_size ranks, replicated across groups.",
    )
    cpu_release_memory: bool = Field(
        False,
        description="fsdp/hsdp on CPU: fix glibc's mmap threshold at 1 MiB so freed all-gather/reduce buffers return to the system (measured: peak RSS 0.44x DDP's instead of 0.87x, steps up to ~2.8x slower).",
    )
    shard_size: int | None = Field(
        None,
        ge=1,
        description="hsdp: ranks per shard group (typically the ranks of one node); must divide the world size.",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Process-group backend; auto picks NCCL when CUDA is available, else gloo."
    )
    timeout_s: float = Field(
        600.0, gt=0, le=MAX_TIMEOUT_S, description="Collective timeout: a rank waiting longer fails instead of hanging."
    )
    startup_timeout_s: float = Field(
        900.0, gt=0, le=MAX_TIMEOUT_S, description="Timeout for the first collectives while all ranks start up."
    )
    watchdog: bool = Field(
        True,
        description="Hang watchdog: fail a rank whose step makes no progress for watchdog_k x p99 step time + watchdog_margin_s (stacks go to run.dir/stacks).",
    )
    watchdog_k: float = Field(
        3.0, gt=1.0, le=1e6, description="Hang watchdog: the step budget in multiples of the observed p99 step time."
    )
    watchdog_margin_s: float = Field(
        30.0,
        ge=0.0,
        le=MAX_TIMEOUT_S,
        description="Hang watchdog: seconds added to the step budget (and to ckpt.timeout_s for saves).",
    )
    watchdog_warmup_steps: int = Field(
        20,
        ge=3,
        description="Hang watchdog: steps timed before the budget is calibrated (until then dist.timeout_s applies).",
    )
    eval_timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S, description="Hang watchdog: budget of one evaluation.")
    bucket_cap_mb: float = Field(
        25.0,
        gt=0,
        le=2**20,
        description="DDP gradient bucket size; smaller buckets start all-reduce earlier in backward.",
    )
    static_graph: bool = Field(False, description="DDP static_graph: the set of used parameters never changes.")
    gradient_as_bucket_view: bool = Field(
        True, description="DDP: gradients alias the all-reduce buckets (saves a copy and memory)."
    )
    find_unused_parameters: bool = Field(
        False, description="DDP: search for parameters without gradients each step (slower)."
    )


class CkptConfig(_Section):
    every_steps: int = Field(
        100, ge=0, description="Save a checkpoint every N optimizer steps (and at the end); 0 only at the end."
    )
    keep: int = Field(
        3,
        ge=1,
        description="Committed checkpoints of this run's timeline to keep; older ones are deleted after a newer commit.",
    )
    resume: LineText = Field(
        "auto",
        description="'auto' continues from the newest good checkpoint in run.dir, 'never' starts fresh, or a checkpoint path.",
    )
    existing: Literal["refuse", "archive"] = Field(
        "refuse",
        description="A fresh start (resume=never, or a checkpoint from another folder) where checkpoints exist: refuse, or move them to checkpoints/archive/ first.",
    )
    on_error: Literal["stop", "continue"] = Field(
        "stop",
        description="When a save fails on any rank: stop the run, or warn, keep training and retry the final save at the end (exit 1 if it still fails).",
    )
    async_save: bool = Field(
        False,
        alias="async",
        description="Write checkpoints in a background thread; the loop only waits for the copy off the device.",
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="How long ranks wait for each other's checkpoint writes before the save fails.",
    )
    hash: Literal["blake3", "sha256"] = Field(
        "blake3",
        description="Checksum of every checkpoint file, named in its manifest: blake3 (cryptographic, several times faster) or sha256 (e.g. where a rule requires it); resume reads either.",
    )
    format: Literal["auto", "sharded", "dcp", "rank0-torch"] = Field(
        "auto",
        description="How checkpoints are written: auto (sharded under dist.strategy=ddp, dcp under fsdp/hsdp), sharded (every rank writes its share of the full state; ddp only), dcp (torch.distributed.checkpoint, every rank its shards; any strategy) or rank0-torch (rank 0 writes one torch.save file per object; ddp only). Resume reads any format, whatever this says.",
    )
    load: Literal["auto", "shared", "every-rank"] = Field(
        "auto",
        description="How ranks resume: shared (each rank reads and verifies about 1/W of the checkpoint, the rest arrives over the network: storage reads it once per job), every-rank (each rank reads and verifies every file it needs: fastest when the ranks share one host's page cache) or auto (shared when the job spans several hosts, every-rank on one host). Either way every byte is verified before anything loads.",
    )


class LogConfig(_Section):
    every_steps: int = Field(
        10,
        ge=1,
        description="Write a metrics.jsonl line (and a terminal line) every N steps; only these steps read values back from the device.",
    )
    tensorboard: bool = Field(
        False, description="Same as listing tensorboard in log.trackers (kept for existing configs)."
    )
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Experiment trackers fed besides metrics.jsonl (rank 0): any of tensorboard, mlflow, wandb; each needs its extra (pip install 'ddptrain[mlflow]').",
    )
    track_artifacts: list[Literal["report", "model"]] = Field(
        default_factory=list,
        description="At the end of a completed run, upload to the trackers: report (the `ddptrain report` PNGs and summary), model (the `ddptrain export` safetensors).",
    )
    tracker_run_name: LineText | None = Field(None, description="Run name shown in MLflow and W&B (None: run.name).")
    tracker_buffer: int = Field(
        5000,
        ge=1,
        description="Records queued per tracker while it is slow or down; beyond that the oldest are dropped (and counted), never waited for.",
    )
    tracker_flush_s: float = Field(
        30.0,
        ge=0,
        description="At the end of a run, wait at most this long for the trackers to deliver what is queued.",
    )
    mlflow_tracking_uri: LineText | None = Field(
        None, description="MLflow tracking server or store URI (None: MLFLOW_TRACKING_URI, else MLflow's default)."
    )
    mlflow_experiment: LineText | None = Field(
        None,
        description="MLflow experiment name, created when missing (None: MLFLOW_EXPERIMENT_NAME or MLFLOW_EXPERIMENT_ID, else 'Default').",
    )
    wandb_project: LineText | None = Field(None, description="W&B project (None: WANDB_PROJECT, else W&B's default).")
    wandb_entity: LineText | None = Field(
        None, description="W&B entity, a user or team (None: WANDB_ENTITY, else your default entity)."
    )
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (None: WANDB_MODE, else online); offline writes run.dir/wandb for `wandb sync`."
    )
    straggler_every: int = Field(
        10,
        ge=0,
        description="Gather per-rank step times every N steps to spot stragglers (keep it a multiple of log.every_steps on GPUs); 0 disables.",
    )
    straggler_factor: float = Field(
        1.15,
        gt=1.0,
        description="Warn when a rank's compute time (net of waiting for a CPU) over the window exceeds the other ranks' median by this factor (two checks in a row).",
    )
    straggler_window: int = Field(30, ge=4, description="Steps the straggler comparison is taken over.")
    replica_check_every: int = Field(
        100,
        ge=0,
        description="Compare the data-parallel replicas' state digests on the first logged step at or after every N steps and before every checkpoint; a divergence stops the run (exit 1) with nothing new committed. 0 disables.",
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="Peak dense TFLOP/s per device for MFU, for devices not in the built-in table (None: use the table).",
    )

    @model_validator(mode="after")
    def _artifacts_need_a_tracker(self) -> LogConfig:
        if self.track_artifacts and not {"mlflow", "wandb"} & set(self.trackers):
            raise ValueError(
                "log.track_artifacts needs mlflow or wandb in log.trackers (there is nowhere to upload to)"
            )
        return self


class Config(_Section):
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

    def check_world_size(self, world_size: int) -> None:
        """Refuse (ConfigError) a world size the batch or the shard groups cannot split over."""
        self.grad_accum_steps(world_size)
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


def describe_fields() -> str:
    """Every config key with its type, default and description (for --help-config)."""
    out = []
    for section_name, field in Config.model_fields.items():
        section = field.default_factory()  # type: ignore[call-arg,misc]
        out.append(f"{section_name}:")
        for name, f in type(section).model_fields.items():
            key = f.alias or name
            out.append(f"  {key} = {getattr(section, name)!r}\n      {f.description}")
    return "\n".join(out)
