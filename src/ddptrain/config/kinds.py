"""Every named kind a config picks from, one line each: the only place each name is written.

Adding a checkpoint format, a checksum, an experiment tracker, an LR schedule or a gradient compression is its
code in its own module plus its line here; the config accepts the name, lists it in its errors and in
`--help-config`, and the layer that uses it imports the code when a run asks for it (registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddptrain.config.registry import Kind, Registry


@dataclass(frozen=True)
class FormatKind(Kind):
    """A checkpoint format (a CheckpointFormat class); `auto_for`: the dist.strategy values ckpt.format=auto
    saves with it."""

    auto_for: tuple[str, ...] = ()


@dataclass(frozen=True)
class HashKind(Kind):
    """A checksum (a function returning a fresh hasher); `shown`: how messages name it."""

    shown: str


@dataclass(frozen=True)
class TrackerKind(Kind):
    """An experiment tracker (a module's `build(cfg, state)`); `package`, when it needs one, is imported only when
    a run asks for it (the ddptrain extra `extra` installs it); `remote`: run behind a background thread, and
    takes uploads (log.track_artifacts)."""

    package: str | None
    extra: str | None
    remote: bool


_FORMATS = "ddptrain.checkpoint.formats"
_FORMAT_KINDS = {
    "sharded": FormatKind(f"{_FORMATS}.sharded:ShardedWriter", "every rank writes its share of the full state; ddp only", ("ddp",)),
    "dcp": FormatKind(f"{_FORMATS}.dcp:DcpWriter", "torch.distributed.checkpoint, every rank its shards; any strategy", ("fsdp", "hsdp")),
    "rank0-torch": FormatKind(f"{_FORMATS}.rank0_torch:RankZeroTorchWriter", "rank 0 writes one torch.save file per object; ddp only"),
}  # fmt: skip
AUTO_FORMAT = "auto"  # ckpt.format's choice that names no format of its own: each strategy's `auto_for` one
FORMATS = Registry(
    "ckpt.format",
    "a checkpoint format",
    _FORMAT_KINDS,
    {AUTO_FORMAT: ", ".join(f"{n} under dist.strategy={'/'.join(k.auto_for)}" for n, k in _FORMAT_KINDS.items() if k.auto_for)},
)  # fmt: skip

HASHES = Registry(
    "ckpt.hash",
    "a checksum",
    {
        "blake3": HashKind("ddptrain.checkpoint.digests:blake3_hasher", "cryptographic, several times faster", "BLAKE3"),
        "sha256": HashKind("hashlib:sha256", "e.g. where a rule requires it", "SHA-256"),
    },
)  # fmt: skip
DEFAULT_HASH = "blake3"

_TRACKERS = "ddptrain.observe.trackers"
TRACKERS = Registry(
    "log.trackers",
    "an experiment tracker",
    {
        "tensorboard": TrackerKind(f"{_TRACKERS}.tensorboard_sink:build", "event files in run.dir/tensorboard", "tensorboard", "tensorboard", remote=False),
        "mlflow": TrackerKind(f"{_TRACKERS}.mlflow_tracker:build", "options in log.mlflow", "mlflow", "mlflow", remote=True),
        "wandb": TrackerKind(f"{_TRACKERS}.wandb_tracker:build", "options in log.wandb", "wandb", "wandb", remote=True),
        "csv": TrackerKind(f"{_TRACKERS}.csv_sink:build", "run.dir/metrics.csv, one row per value, for spreadsheets", None, None, remote=False),
    },
)  # fmt: skip

_SCHEDULES = "ddptrain.train.schedules"
SCHEDULES = Registry(
    "schedule.name",
    "an LR schedule",
    {
        "cosine": Kind(f"{_SCHEDULES}:COSINE", "cosine decay to train.min_lr_ratio at max_steps"),
        "wsd": Kind(f"{_SCHEDULES}:WSD", "stable at lr, then a linear decay over the last decay_fraction of the run"),
        "linear": Kind(f"{_SCHEDULES}:LINEAR", "linear decay to train.min_lr_ratio at max_steps"),
        "constant": Kind(f"{_SCHEDULES}:CONSTANT", "no decay"),
    },
)  # fmt: skip
DEFAULT_SCHEDULE = "cosine"

_COMPRESSION = "ddptrain.train.compression"
NO_COMPRESSION = "none"  # dist.grad_compression's choice that names no hook: DDP's own fp32 all-reduce
GRAD_COMPRESSIONS = Registry(
    "dist.grad_compression",
    "a gradient compression",
    {
        "fp16": Kind(f"{_COMPRESSION}:Fp16", "gradients all-reduced as float16: half the bytes; NCCL and gloo"),
        "bf16": Kind(f"{_COMPRESSION}:Bf16", "gradients all-reduced as bfloat16: half the bytes, fp32's range; NCCL only, gloo has no bfloat16 all-reduce"),
        "powersgd": Kind(f"{_COMPRESSION}:PowerSgd", "rank-dist.powersgd_rank factors with error feedback from dist.powersgd_start_step: ~10-100x fewer bytes; NCCL and gloo"),
    },
    {NO_COMPRESSION: "fp32 all-reduce, every byte"},
)  # fmt: skip

_SYNC = "ddptrain.train.sync"
EVERY_STEP = "every_step"  # the synchronization of a run without train.diloco
IN_PLACE = "in_place"  # the synchronization of a replica group in the in-place mode (ft_env.py)
SYNCS = Registry(
    "the synchronization",
    "a synchronization",
    {
        EVERY_STEP: Kind(f"{_SYNC}.every_step:EveryStep", "every step reduces the gradients (DDP, FSDP; dist.grad_compression)"),
        IN_PLACE: Kind(f"{_SYNC}.in_place:InPlace", "a replica group of the in-place mode (torchft): quorum, sum over the live groups, commit vote, heal; every step, or at DiLoCo's outer syncs"),
        "diloco": Kind(f"{_SYNC}.diloco:DiLoCo", "groups take train.diloco.every_steps inner steps, then an outer step on their mean pseudo-gradient"),
    },
)  # fmt: skip
