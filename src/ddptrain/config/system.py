"""The sections around training: run (name, folder, seed), dist, ckpt and log."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from ddptrain.config.base import MAX_SEED, MAX_TIMEOUT_S, LineText, Section
from ddptrain.config.kinds import DEFAULT_HASH, FORMATS, GRAD_COMPRESSIONS, HASHES, NO_COMPRESSION, TRACKERS
from ddptrain.config.trackers import MLflowOptions, WandbOptions
from ddptrain.config_io import (
    folder_name,
)


class RunConfig(Section):
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


class DistConfig(Section):
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
    ft_timeout_s: float = Field(
        30.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="In-place fault tolerance (ddptrain launch --fault-tolerance torchft): how long a cross-group all-reduce, a commit vote or a heal's transfer may take before the step is discarded.",
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
    grad_compression: Annotated[str, AfterValidator(GRAD_COMPRESSIONS.check)] = Field(
        NO_COMPRESSION,
        description=f"How the gradients' all-reduce is compressed (docs/slow-links.md): {GRAD_COMPRESSIONS.explained()}. Under fsdp/hsdp fp16 and bf16 are the gradients' reduce dtype; powersgd is ddp only.",
    )
    powersgd_rank: int = Field(
        4, ge=1, le=1024, description="grad_compression=powersgd: the rank of each gradient matrix's approximation."
    )
    powersgd_start_step: int = Field(
        100,
        ge=3,
        description="grad_compression=powersgd: the first compressed step; the steps before it all-reduce every byte (PowerSGD's advice: about 10% of the run, no fewer than the warm-up).",
    )

    @model_validator(mode="after")
    def _compression_is_ddp(self) -> DistConfig:
        if self.grad_compression == "powersgd" and self.strategy != "ddp":
            raise ValueError(
                f"dist.grad_compression=powersgd compresses DDP's all-reduce: dist.strategy={self.strategy} "
                "reduces gradients without DDP's communication hooks (fp16 or bf16 set FSDP's reduce dtype)"
            )
        return self


class CkptConfig(Section):
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
    hash: Annotated[str, AfterValidator(HASHES.check)] = Field(
        DEFAULT_HASH,
        description=f"Checksum of every checkpoint file, named in its manifest: {HASHES.explained()}; resume reads any.",
    )
    format: Annotated[str, AfterValidator(FORMATS.check)] = Field(
        "auto",
        description=f"How checkpoints are written: {FORMATS.explained()}. Resume reads any format, whatever this says.",
    )
    load: Literal["auto", "shared", "every-rank"] = Field(
        "auto",
        description="How ranks resume: auto (the checkpoint's files are split over the hosts: each host's ranks read and verify that host's share themselves, sharing its page cache, and receive the rest from the other hosts: storage reads it once per job), every-rank (each rank reads and verifies every file it needs, nothing is sent) or shared (each rank reads and verifies about 1/W, the rest arrives from the other ranks, even on one host). Either way every byte is verified before anything loads.",
    )


class LogConfig(Section):
    every_steps: int = Field(
        10,
        ge=1,
        description="Write a metrics.jsonl line (and a terminal line) every N steps; only these steps read values back from the device.",
    )
    tensorboard: bool = Field(
        False, description="Same as listing tensorboard in log.trackers (kept for existing configs)."
    )
    trackers: list[Annotated[str, AfterValidator(TRACKERS.check)]] = Field(
        default_factory=list,
        description=f"Experiment trackers fed besides metrics.jsonl (rank 0), any of: {TRACKERS.explained()}; each needs its extra where it has one (pip install 'ddptrain[mlflow]').",
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
    mlflow: MLflowOptions = Field(
        default_factory=MLflowOptions, description="The mlflow tracker's options: {tracking_uri, experiment}."
    )
    wandb: WandbOptions = Field(
        default_factory=WandbOptions, description="The wandb tracker's options: {project, entity, mode}."
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
    certificate: bool = Field(
        True,
        description="On every logged step rank 0 digests the model and optimizer state into run.dir/certificate.jsonl, what `ddptrain verify-resume` compares a replay with; false skips the digest (and verify-resume refuses the run).",
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="Peak dense TFLOP/s per device for MFU, for devices not in the built-in table (None: use the table).",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        # A null is what an older version's config.yaml holds for every key it had: it means the default still.
        given = [key for key in RENAMED if isinstance(data, dict) and data.get(key) is not None]
        if given:
            raise ValueError(", ".join(f"log.{key} is now log.{RENAMED[key]}" for key in given))
        return {k: v for k, v in data.items() if k not in RENAMED} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _artifacts_need_a_tracker(self) -> LogConfig:
        uploading = [name for name, kind in TRACKERS.items() if kind.remote]
        if self.track_artifacts and not set(uploading) & set(self.trackers):
            raise ValueError(
                f"log.track_artifacts needs one of {', '.join(uploading)} in log.trackers (there is nowhere to upload to)"
            )
        return self


# Keys of log that earlier versions had, and where each is now: given a value, they stop the run with this hint
# (a config an earlier version recorded is read with them moved: `current_keys`).
RENAMED = {
    "mlflow_tracking_uri": "mlflow.tracking_uri",
    "mlflow_experiment": "mlflow.experiment",
    "wandb_project": "wandb.project",
    "wandb_entity": "wandb.entity",
    "wandb_mode": "wandb.mode",
}


def current_keys(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """A config an earlier version recorded, with its renamed log keys (RENAMED) moved to where they are now."""
    log = data.get("log")
    if not isinstance(log, dict) or not RENAMED.keys() & log.keys():
        return data
    log = {k: v for k, v in log.items() if k not in RENAMED}
    for old, new in RENAMED.items():
        section, key = new.split(".")
        value = data["log"].get(old)
        if value is not None and isinstance(log.setdefault(section, {}), dict):
            log[section] = {key: value, **log[section]}
    return {**data, "log": log}
