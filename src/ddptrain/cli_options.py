"""Command-line options derived from a dataclass's fields, so each default is written once.

A field declared with `option(...)` becomes `--field-name` (or the flag given) on the subcommand's
parser with the field's default, type (from its annotation: `int | None` reads an int) and help;
`from_args` builds the dataclass back from the parsed namespace. Fields without `option` metadata
are not options (set them in code). A command function takes one such dataclass (`options_type`).

A help that names `{default}` shows the default there (formatted as written, e.g. `{default:,}`);
any other gets " (default X)" appended unless the default is empty, a flag's False, or
`show_default=False`. Any other `{name}` in a help is the dataclass's class attribute `name`, so that a
base class's options read right in each subclass (`{node}`: a node, a pod). A field without a default (`option(REQUIRED, ...)`) is a required option, or
a required argument when positional.
"""

from __future__ import annotations

import argparse
import dataclasses
import string
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_META = "ddptrain_option"
REQUIRED: Any = dataclasses.MISSING  # a field the caller must give: no default


def option(
    default: Any,
    help: str | None,
    *,
    flag: str | None = None,
    short: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
    choices: tuple[str, ...] | None = None,
    required: bool = False,
    positional: bool = False,
    remainder: bool = False,
    show_default: bool = True,
) -> Any:
    """A dataclass field that is also a command-line option (`repeat`: a tuple built from repeated flags, or
    from every remaining argument when `positional`; `short`: a one-letter alias such as -c; `remainder`: the
    words after `--`, a tuple without the `--` itself)."""
    meta = {
        _META: {
            "help": help,
            "flag": flag,
            "short": short,
            "metavar": metavar,
            "parse": parse,
            "repeat": repeat,
            "choices": choices,
            "required": required or default is REQUIRED,
            "positional": positional,
            "remainder": remainder,
            "show_default": show_default,
        }
    }
    if default is REQUIRED:
        return dataclasses.field(metadata=meta)
    if repeat or remainder:
        return dataclasses.field(default=tuple(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flag(field: dataclasses.Field[Any]) -> str:
    return field.metadata[_META]["flag"] or "--" + field.name.replace("_", "-")


def _help(spec: type[Any], meta: dict[str, Any], default: Any) -> str | None:
    text: str | None = meta["help"]
    if text is None:
        return None
    names = {name for _, name, _, _ in string.Formatter().parse(text) if name}
    if names:
        text = text.format(default=default, **{name: getattr(spec, name) for name in names - {"default"}})
    hidden = default in (None, (), "", dataclasses.MISSING) or isinstance(default, bool) or "default" in names
    return text if hidden or meta["required"] or not meta["show_default"] else f"{text} (default {default})"


def _value_type(hint: Any) -> Any:
    """The type one command-line value reads as: `int | None` -> int, `tuple[str, ...]` -> str."""
    inner = [a for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
    return _value_type(inner[0]) if inner else hint


def add_options(parser: argparse.ArgumentParser, spec: type[Any]) -> None:
    """Register one option (or positional argument) per `option(...)` field of the dataclass `spec`."""
    hints = typing.get_type_hints(spec)
    for field in dataclasses.fields(spec):
        meta = field.metadata.get(_META)
        if meta is None:
            continue
        default = field.default
        kind = meta["parse"] or _value_type(hints[field.name])
        kwargs: dict[str, Any] = {"help": _help(spec, meta, default)}
        if meta["remainder"]:
            parser.add_argument(field.name, nargs=argparse.REMAINDER, **kwargs)
            continue
        if meta["positional"]:
            kwargs.update(nargs="*" if meta["repeat"] else None, type=kind)
            parser.add_argument(field.name, **kwargs)
            continue
        kwargs["dest"] = field.name
        if meta["repeat"]:
            kwargs.update(action="append", default=None, type=kind)
        elif kind is bool:
            kwargs.update(action="store_true", default=default)
        else:
            kwargs.update(default=None if default is dataclasses.MISSING else default, type=kind)
        if meta["choices"]:
            kwargs["choices"] = meta["choices"]
        elif kind is not bool:
            kwargs["metavar"] = meta["metavar"] or _flag(field).lstrip("-").upper().replace("-", "_")
        if meta["required"]:
            kwargs["required"] = True
        parser.add_argument(*filter(None, (meta["short"], _flag(field))), **kwargs)


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


def options_type(command: Callable[[T], int]) -> type[T]:
    """The options dataclass a command function takes: the annotation of its one parameter."""
    hints = typing.get_type_hints(command)
    (name,) = (name for name in hints if name != "return")
    return hints[name]  # type: ignore[no-any-return]


def to_argv(options: Any) -> list[str]:
    """The command line that `from_args` reads back as `options`: each option that differs from its default.

    For flag options and the `--` remainder only (what `ddptrain launch` passes to the launches it starts).
    """
    argv: list[str] = []
    remainder: tuple[str, ...] = ()
    for field in dataclasses.fields(options):
        meta = field.metadata.get(_META)
        value = getattr(options, field.name)
        if meta is None or value == field.default:
            continue
        if meta["remainder"]:
            remainder = tuple(value)
        elif meta["positional"] or meta["repeat"]:
            raise TypeError(f"to_argv does not write {field.name} (positional or repeated)")
        elif isinstance(value, bool):
            argv += [_flag(field)] if value else []
        else:
            argv.append(f"{_flag(field)}={value}")  # one word: a value starting with '-' stays a value
    return [*argv, "--", *remainder] if remainder else argv
