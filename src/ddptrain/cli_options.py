"""Command-line options derived from a job spec's dataclass fields, so each default is written once.

A field declared with `option(...)` becomes `--field-name` (or the flag given) on the subcommand's
parser with the field's default, type and help; `from_args` builds the spec back from the parsed
namespace. Fields without `option` metadata are not options (set them in code).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_META = "ddptrain_option"


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
    choices: tuple[str, ...] | None = None,
    required: bool = False,
) -> Any:
    """A dataclass field that is also a command-line option (`repeat`: a tuple built from repeated flags)."""
    meta = {
        _META: {"help": help, "flag": flag, "parse": parse, "repeat": repeat, "choices": choices, "required": required}
    }
    if repeat:
        return dataclasses.field(default=tuple(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flag(field: dataclasses.Field[Any]) -> str:
    return field.metadata[_META]["flag"] or "--" + field.name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, spec: type[Any]) -> None:
    """Register one option per `option(...)` field of the dataclass `spec`."""
    for field in dataclasses.fields(spec):
        meta = field.metadata.get(_META)
        if meta is None:
            continue
        default = field.default
        shown = "" if default in (None, (), "") or meta["required"] else f" (default {default})"
        kwargs: dict[str, Any] = {"dest": field.name, "help": meta["help"] + shown}
        if meta["repeat"]:
            kwargs.update(action="append", default=None, type=meta["parse"] or str)
        elif isinstance(default, bool):
            kwargs.update(action="store_true", default=default)
        else:
            kwargs.update(default=default, type=meta["parse"] or (type(default) if default is not None else str))
        if meta["choices"]:
            kwargs["choices"] = meta["choices"]
        elif not isinstance(default, bool):
            kwargs["metavar"] = _flag(field).lstrip("-").upper().replace("-", "_")
        if meta["required"]:
            kwargs["required"] = True
        parser.add_argument(_flag(field), **kwargs)


def from_args(spec: Callable[..., T], args: argparse.Namespace) -> T:
    """The dataclass `spec` built from the options `add_options` registered."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(spec):  # type: ignore[arg-type]
        if _META in field.metadata and hasattr(args, field.name):
            value = getattr(args, field.name)
            if field.metadata[_META]["repeat"]:
                value = tuple(value or ())
            values[field.name] = value
    return spec(**values)
