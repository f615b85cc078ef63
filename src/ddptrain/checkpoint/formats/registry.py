"""Every checkpoint format by the name its manifests record (one line each), and the choice of ckpt.format.

A new format is its module in this package plus its line in FORMATS (and its name in ckpt.format's
Literal in config.py, which sits below checkpoint/: tests/unit/test_checkpoint_formats.py checks
that the two agree).
"""

from __future__ import annotations

from ddptrain.checkpoint.formats.base import CheckpointFormat
from ddptrain.checkpoint.formats.dcp import DcpWriter
from ddptrain.checkpoint.formats.rank0_torch import RankZeroTorchWriter
from ddptrain.checkpoint.formats.sharded import ShardedWriter
from ddptrain.errors import ConfigError

FORMATS: dict[str, type[CheckpointFormat]] = {
    RankZeroTorchWriter.name: RankZeroTorchWriter,  # rank 0 writes everything (the first format)
    ShardedWriter.name: ShardedWriter,  # every rank writes its share of the full state
    DcpWriter.name: DcpWriter,  # every rank its shards, through torch.distributed.checkpoint
}

# ckpt.format=auto: the format each dist.strategy saves with unless the config names one.
AUTO: dict[str, str] = {"ddp": ShardedWriter.name, "fsdp": DcpWriter.name, "hsdp": DcpWriter.name}


def format_named(name: str) -> CheckpointFormat | None:
    """A new instance of the format a manifest names (its `writer`); None for a name this ddptrain does not know."""
    cls = FORMATS.get(name)
    return cls() if cls is not None else None


def checkpoint_format(choice: str, strategy: str) -> CheckpointFormat:
    """The format a run saves with: ckpt.format, or for `auto` the strategy's (AUTO).

    ConfigError (exit 2, one line) when the chosen format cannot save this strategy's state.
    """
    name = AUTO[strategy] if choice == "auto" else choice
    cls = FORMATS.get(name)
    if cls is None:
        raise ConfigError(f"ckpt.format={choice!r} is not a checkpoint format: pick one of auto, {', '.join(FORMATS)}")
    if strategy not in cls.strategies:
        able = ", ".join(n for n, c in FORMATS.items() if strategy in c.strategies)
        raise ConfigError(
            f"ckpt.format={name} cannot save a dist.strategy={strategy} run; use ckpt.format=auto or one of: {able}"
        )
    return cls()
