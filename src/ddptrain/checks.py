"""Checks of command-line arguments: each failure is a ConfigError naming the flag (exit 2, one line)."""

from __future__ import annotations

import math
import unicodedata
from pathlib import Path

from ddptrain.errors import ConfigError


def number_in(flag: str, value: float, low: float, high: float, *, low_open: bool = False) -> float:
    """value, when finite and in [low, high] (or (low, high] with low_open)."""
    above = value > low if low_open else value >= low
    if not (math.isfinite(value) and above and value <= high):
        bracket = "(" if low_open else "["
        raise ConfigError(f"{flag} {value} must be a finite number in {bracket}{low:g}, {high:g}]")
    return value


def text_arg(flag: str, value: str, *, single_line: bool = True) -> str:
    """value, when it is valid UTF-8 (no undecodable bytes from the command line) and, if asked, one line."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{flag} is not valid UTF-8 text") from None
    if single_line and any(ord(c) < 32 and c != "\t" for c in value):
        raise ConfigError(f"{flag} {value!r} must be one line of printable text (no newlines or control characters)")
    return value


# Unicode categories that must never reach a generated script or manifest: control characters
# (newline, carriage return, NUL, escape, tab), format characters (bidirectional overrides that make
# a line read differently from what runs) and the line and paragraph separators.
_UNSCRIPTABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def first_unprintable(value: str) -> str | None:
    """The first character of value in one of those categories (None when there is none): one rule for
    names and paths in the config, in generated scripts and in manifests."""
    return next((c for c in value if unicodedata.category(c) in _UNSCRIPTABLE), None)


def script_text(what: str, value: str) -> str:
    """value, when it may be written into a generated job script or manifest (a comment, a quoted word).

    A newline would end a comment or an #SBATCH directive and start a shell line of its own; the
    other control and format characters have no business in a name or a path either.
    """
    text_arg(what, value, single_line=False)
    bad = first_unprintable(value)
    if bad is not None:
        raise ConfigError(
            f"{what} {value!r} must be one line of printable text (no newlines or control characters, "
            f"here {bad!r}): it is written into a generated job script"
        )
    return value


def output_file(flag: str, path: Path) -> Path:
    """A file to write: not an existing folder, in a folder that exists."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name")
    if not path.parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {path.parent} does not exist")
    return path


def creatable_file(flag: str, path: Path) -> Path:
    """A file to write whose missing folders will be created: not a folder, and no file where a folder must be."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name")
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{flag} {path}: {blocking} is a file, not a folder (Not a directory)")
    return path


def output_dir(flag: str, path: Path) -> Path:
    """A folder to write into (created when missing): not an existing file."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} exists and is not a folder")
    return path


def existing_dir(what: str, path: Path) -> Path:
    """A folder that must exist (e.g. a run folder to read)."""
    if not path.is_dir():
        raise ConfigError(f"{what} {path} is not a folder" if path.exists() else f"{what} {path} does not exist")
    return path
