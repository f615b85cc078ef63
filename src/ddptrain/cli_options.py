"""Command-line options derived from an options dataclass's fields, so each default is written once.

A field declared with `option(...)` becomes `--field-name` (or the flag given) on the subcommand's
parser with the field's default, type and help; `from_args` builds the spec back from the parsed
namespace. Fields without `option` metadata are not options (set them in code).

A help text ends with "(default VALUE)" unless it names `{default}` itself (with a format spec if
it likes, `{default:g}`); any other `{name}` in it is the dataclass's class attribute `name`, so
that a base class's options read right in each subclass (`{node}`: a node, a pod).
"""

from __future__ import annotations

import argparse
import dataclasses
import string
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
    short: str | None = None,
    positional: bool = False,
    remainder: bool = False,
) -> Any:
    """A dataclass field that is also a command-line option.

    `repeat`: a tuple built from repeated flags (or, `positional`, from every positional word);
    `short`: a one-letter flag beside the long one; `positional`: an argument without a flag;
    `remainder`: the words after `--` (a tuple; the `--` itself is not kept).
    """
    meta = {
        _META: {
            "help": help,
            "flag": flag,
            "parse": parse,
            "repeat": repeat,
            "choices": choices,
            "required": required,
            "short": short,
            "positional": positional,
            "remainder": remainder,
        }
    }
    if repeat or remainder:
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
        kwargs: dict[str, Any] = {"help": _help(spec, field.default, meta)}
        if meta["remainder"]:
            parser.add_argument(field.name, nargs=argparse.REMAINDER, **kwargs)
            continue
        if meta["positional"]:
            if meta["repeat"]:
                kwargs["nargs"] = "*"
            parser.add_argument(field.name, **kwargs)
            continue
        kwargs.update(_value_kwargs(field, meta))
        parser.add_argument(*filter(None, (meta["short"], _flag(field))), dest=field.name, **kwargs)


def _help(spec: type[Any], default: Any, meta: dict[str, Any]) -> str:
    text: str = meta["help"]
    names = {name for _, name, _, _ in string.Formatter().parse(text) if name}
    if names:
        text = text.format(default=default, **{name: getattr(spec, name) for name in names - {"default"}})
    hidden = default in (None, (), "") or isinstance(default, bool) or meta["required"] or "default" in names
    return text if hidden else f"{text} (default {default})"


def _value_kwargs(field: dataclasses.Field[Any], meta: dict[str, Any]) -> dict[str, Any]:
    """How argparse reads the option's value: its action, default, type, choices or metavar."""
    default = field.default
    kwargs: dict[str, Any]
    if meta["repeat"]:
        kwargs = {"action": "append", "default": None, "type": meta["parse"] or str}
    elif isinstance(default, bool):
        kwargs = {"action": "store_true", "default": default}
    else:
        kwargs = {"default": default, "type": meta["parse"] or (type(default) if default is not None else str)}
    if meta["choices"]:
        kwargs["choices"] = meta["choices"]
    elif not isinstance(default, bool):
        kwargs["metavar"] = _flag(field).lstrip("-").upper().replace("-", "_")
    if meta["required"]:
        kwargs["required"] = True
    return kwargs


def from_args(spec: Callable[..., T], args: argparse.Namespace) -> T:
    """The dataclass `spec` built from the options `add_options` registered."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(spec):  # type: ignore[arg-type]
        if _META in field.metadata and hasattr(args, field.name):
            value = getattr(args, field.name)
            meta = field.metadata[_META]
            if meta["remainder"] and value[:1] == ["--"]:
                value = value[1:]  # argparse keeps the `--` that starts the remainder; here is the one place it goes
            if meta["repeat"] or meta["remainder"]:
                value = tuple(value or ())
            values[field.name] = value
    return spec(**values)
