"""The checkpoint format a run saves with (ckpt.format), and the one a manifest names (its `writer`).

Every format is its module in this package plus its line in config/kinds.py's FORMATS, which names it
(the name its manifests record) and the strategies ckpt.format=auto saves with it.
"""

from __future__ import annotations

from ddptrain.checkpoint.formats.base import CheckpointFormat
from ddptrain.config.kinds import AUTO_FORMAT, FORMATS
from ddptrain.errors import ConfigError


def format_class(name: str) -> type[CheckpointFormat]:
    """The class of the format registered as `name` (imported on first use); KeyError for an unknown name."""
    cls: type[CheckpointFormat] = FORMATS.load(name)
    return cls


def format_named(name: str) -> CheckpointFormat | None:
    """A new instance of the format a manifest names (its `writer`); None for a name this ddptrain does not know."""
    return format_class(name)() if name in FORMATS else None


def auto_format(strategy: str) -> str:
    """The format ckpt.format=auto saves a dist.strategy run with."""
    return next(name for name, kind in FORMATS.items() if strategy in kind.auto_for)


def checkpoint_format(choice: str, strategy: str) -> CheckpointFormat:
    """The format a run saves with: ckpt.format, or for `auto` the strategy's (its `auto_for` in FORMATS).

    ConfigError (exit 2, one line) when the chosen format cannot save this strategy's state.
    """
    if choice != AUTO_FORMAT and choice not in FORMATS:
        raise ConfigError(
            f"ckpt.format={choice!r} is not a checkpoint format: pick one of {', '.join(FORMATS.choices)}"
        )
    name = auto_format(strategy) if choice == AUTO_FORMAT else choice
    cls = format_class(name)
    if strategy not in cls.strategies:
        able = ", ".join(n for n in FORMATS if strategy in format_class(n).strategies)
        raise ConfigError(
            f"ckpt.format={name} cannot save a dist.strategy={strategy} run; use ckpt.format=auto or one of: {able}"
        )
    return cls()
