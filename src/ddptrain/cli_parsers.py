"""The argparse classes of the `ddptrain` command: a refused command line is one line and exit 2.

argparse prints the whole usage block (4-16 lines) above its message and calls sys.exit(2); here
the parser raises instead, and `cli.main` prints one line naming the subcommand (`--help` still
shows the usage). Every subcommand's parser is of the same class: add_subparsers makes them so.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from ddptrain.errors import ConfigError


class UsageError(ConfigError):
    """A command line argparse refused (exit 2); `prog` is the parser's, e.g. `ddptrain launch`."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class OneLineParser(argparse.ArgumentParser):
    """The CLI's parser and, through add_subparsers, every subcommand's: errors raise UsageError."""

    def error(self, message: str) -> NoReturn:
        """Raise UsageError instead of printing the usage block and exiting."""
        raise UsageError(self.prog, message)


class WorkerCommandParser(argparse.ArgumentParser):
    """The parser `launch` checks its worker command with: errors are ConfigErrors naming the worker command."""

    def error(self, message: str) -> NoReturn:
        """Raise ConfigError instead of printing the usage block and exiting."""
        raise ConfigError(f"worker command: {message}")


def usage_prog(prog: str, message: str, argv: list[str]) -> str:
    """The command a parse error belongs to: argparse reports a subcommand's unrecognized arguments from
    the top parser, after the subcommand (the first argument: the top parser has no options) parsed."""
    if prog == "ddptrain" and message.startswith("unrecognized arguments") and argv and not argv[0].startswith("-"):
        return f"ddptrain {argv[0]}"
    return prog
