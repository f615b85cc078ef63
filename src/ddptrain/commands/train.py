"""`ddptrain train [-c CONFIG] [OVERRIDES...]`: this process's share of a training run (alone or under torchrun)."""

from __future__ import annotations

from dataclasses import dataclass

from ddptrain import run
from ddptrain.cli_options import option
from ddptrain.config import describe_fields
from ddptrain.train.preemption import hold_until_exit


@dataclass(frozen=True)
class TrainOptions:
    """What `ddptrain train` reads from its command line."""

    config: str | None = option(None, "YAML config file (default: the built-in defaults)", short="-c")
    overrides: tuple[str, ...] = option((), "dotted overrides, e.g. train.max_steps=100", positional=True, repeat=True)
    help_config: bool = option(False, "list every config key with its default and meaning")


def train(options: TrainOptions) -> int:
    """Train per the config on this process's share of the job (or list the config keys); returns the exit code."""
    if options.help_config:
        print(describe_fields())
        return 0
    hold_until_exit()  # this process ends with the run: a late signal must not replace the first one's exit code
    result = run.train(options.config, overrides=options.overrides)
    return result.exit_code
