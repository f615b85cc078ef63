"""Reading a config: the YAML file, dotted command-line overrides, and the bounds every config keeps.

A config is stored whole in config.yaml and in every checkpoint's manifest (read back at resume,
export, eval, generate, and refused there above 64 MiB). So the size of a config is bounded when
it is loaded, not when its first checkpoint turns out unreadable: YAML aliases are counted as they
expand (a "billion laughs" of nested aliases is refused while the file is composed, before any
expansion exists), and so are depth, values, text and the file itself. Any config within the
bounds below encodes in a manifest in at most MAX_CONFIG_JSON_BYTES (checked after validation,
too), leaving 56 MiB of the reader's limit to the checkpoint's list of files (over 400,000 of
them); the manifest's writer refuses to commit past that limit (a failed save, never a checkpoint
that cannot be read back).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ddptrain.checks import first_unprintable
from ddptrain.errors import ConfigError
from ddptrain.safe_files import read_regular_file

MAX_CONFIG_DEPTH = 32  # mappings and lists nested in each other (the sections are level 1)
MAX_CONFIG_VALUES = 20_000  # keys, values and list items, aliases counted as often as they are used
MAX_CONFIG_CHARS = 256 << 10  # characters of text in keys and values, aliases counted likewise
# What the bounds above allow, stored: config.yaml (Config.to_yaml: one line per value, indented 2 per
# level, a character at most 6 bytes as a YAML escape) is at most ~3 MB, under the file limit, so a run's
# config.yaml always loads again; the manifest's JSON (indent 1, a character at most 12 bytes as \u
# escapes) at most ~4 MB, checked after validation against MAX_CONFIG_JSON_BYTES, an eighth of the 64 MiB
# a manifest may take (the rest is the checkpoint's list of files).
MAX_CONFIG_FILE_BYTES = 4 << 20
MAX_CONFIG_JSON_BYTES = 8 << 20


NAME_MAX = 255  # bytes in one folder name (Linux, macOS)


def one_line_text(value: str) -> str:
    """value, when it holds no control character or line break (ValueError naming the first)."""
    # A newline in a path or a name ends the line it is written into (a script, a log line, a terminal);
    # format characters (a text-direction override) make a line read differently from what it holds.
    bad = first_unprintable(value)
    if bad is not None:
        raise ValueError(f"must be one line without control characters (found {bad!r} at character {value.index(bad)})")
    return value


def folder_name(value: str) -> str:
    """value, when it can be one folder's name under runs/: one line, not empty, '.' or '..', no '/'."""
    one_line_text(value)
    if value in ("", ".", "..") or "/" in value or len(value.encode("utf-8", "surrogatepass")) > NAME_MAX:
        raise ValueError(
            f"must name one folder under runs/ (not empty, '.' or '..', no '/', at most {NAME_MAX} bytes), "
            f"got {value[:40]!r}"
        )
    return value


def _too_big(what: str, where: str) -> ConfigError:
    return ConfigError(
        f"{where} {what}; a config is limited to {MAX_CONFIG_DEPTH} levels of nesting, {MAX_CONFIG_VALUES:,} "
        f"values and {MAX_CONFIG_CHARS:,} characters of text (YAML aliases counted each time they are used)"
    )


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate keys, and a document nested too deep or too big once its
    aliases are expanded: measured node by node while it is composed, before anything is built."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._open = 0  # nodes being composed around the current one
        self._sizes: dict[yaml.Node, tuple[int, int, int]] = {}  # node: (values, chars, height) expanded

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        alias = self.check_event(yaml.AliasEvent)
        mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
        self._open += 1
        try:
            if self._open > MAX_CONFIG_DEPTH + 1:  # stops the composer's recursion early
                raise _too_big(f"nests deeper than {MAX_CONFIG_DEPTH} levels", self._where(mark))
            node = super().compose_node(parent, index)
        finally:
            self._open -= 1
        if node is None:
            return None
        if node not in self._sizes:
            if alias:  # an anchor used inside itself: the expansion never ends
                raise ConfigError(f"{self._where(mark)} uses an alias inside its own anchor (a recursive config)")
            self._sizes[node] = _measure(node, self._sizes)
        values, chars, height = self._sizes[node]
        if self._open + height > MAX_CONFIG_DEPTH:
            raise _too_big(f"nests deeper than {MAX_CONFIG_DEPTH} levels", self._where(mark))
        if values > MAX_CONFIG_VALUES:
            raise _too_big(f"expands to more than {MAX_CONFIG_VALUES:,} values", self._where(mark))
        if chars > MAX_CONFIG_CHARS:
            raise _too_big(f"expands to more than {MAX_CONFIG_CHARS:,} characters", self._where(mark))
        return node

    def _where(self, mark: yaml.Mark) -> str:
        return f"{mark.name}, line {mark.line + 1}:"

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (the later one would silently replace the earlier)",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _measure(node: yaml.Node, sizes: dict[yaml.Node, tuple[int, int, int]]) -> tuple[int, int, int]:
    """(values, characters, height) of a freshly composed node; its children are measured already."""
    if isinstance(node, yaml.ScalarNode):
        return 1, len(node.value), 0
    children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
    measured = [sizes[child] for child in children]
    return (
        1 + sum(m[0] for m in measured),
        sum(m[1] for m in measured),
        1 + max((m[2] for m in measured), default=0),
    )


_BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _BoundedLoader.construct_mapping)
# YAML 1.1 reads `3e-4` (no dot) as a string; every user means a number (strict mode would refuse
# the string where pydantic's lax mode used to convert it).
_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_yaml(text: str, name: str = "<value>") -> Any:
    """Parse YAML safely within the config's bounds, refusing duplicate keys; errors point at `name`, line and
    column (yaml.YAMLError for malformed YAML, ConfigError for a document past the bounds)."""
    stream = io.StringIO(text)
    stream.name = name  # what PyYAML's error marks show
    try:
        return yaml.load(stream, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except ValueError as e:  # an integer past Python's 4300-digit conversion limit
        raise ConfigError(f"{name}: {_one_line(str(e))}") from None


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file's content; ConfigError (one line) when missing, not a regular file (a FIFO is refused,
    never waited on), larger than MAX_CONFIG_FILE_BYTES, unreadable or not UTF-8."""
    if not path.exists():
        raise ConfigError(f"{what} not found: {path}")
    if not path.is_file():
        raise ConfigError(f"{what} {path} is not a file")
    try:
        data = read_regular_file(path, MAX_CONFIG_FILE_BYTES, follow=True)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_CONFIG_FILE_BYTES:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """The mapping a YAML file holds (empty for an empty file), read and parsed within the bounds above; ConfigError
    (one line naming the file as `what PATH`) when it cannot be read, is not YAML or holds something else."""
    text = read_text_file(path, what)
    try:
        loaded = load_yaml(text, str(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded or {}


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.max_steps=100)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override key {key[:80]!r} must be dotted, like train.max_steps")
    if len(parts) > MAX_CONFIG_DEPTH:
        raise _too_big(f"override key {key[:40]!r}... nests deeper than {MAX_CONFIG_DEPTH} levels", "the")
    try:
        value = load_yaml(raw, f"override {parts[0]}.{parts[1]}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `a.b.c=value` (value parsed as YAML) into the nested dict."""
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item[:80]!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def check_bounds(data: Any) -> None:
    """ConfigError when a mapping of sections (a file and its overrides together, or a Python-API mapping) is past
    the bounds; the walk stops at the first excess, so a huge (or cyclic) structure costs no more than the bounds."""
    values = chars = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        values += 1
        if isinstance(item, (dict, list, tuple)):
            if depth >= MAX_CONFIG_DEPTH:
                raise _too_big(f"nests deeper than {MAX_CONFIG_DEPTH} levels", "the config")
            children = [c for pair in item.items() for c in pair] if isinstance(item, dict) else list(item)
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, str):
            chars += len(item)
        elif isinstance(item, int):
            chars += item.bit_length() // 3 + 1  # at least its decimal digits
        if values > MAX_CONFIG_VALUES:
            raise _too_big(f"holds more than {MAX_CONFIG_VALUES:,} values", "the config")
        if chars > MAX_CONFIG_CHARS:
            raise _too_big(f"holds more than {MAX_CONFIG_CHARS:,} characters of text", "the config")


def check_encoded_size(dumped: dict[str, Any]) -> None:
    """ConfigError when the validated config (model_dump in JSON mode) would take more than MAX_CONFIG_JSON_BYTES
    in a manifest: measured with the manifest's own encoding, so what loads can always be saved and read back."""
    size = len(json.dumps(dumped, indent=1, ensure_ascii=True, allow_nan=False))
    if size > MAX_CONFIG_JSON_BYTES:
        raise ConfigError(f"the config takes {size:,} bytes as JSON, more than {MAX_CONFIG_JSON_BYTES:,}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def format_validation_error(err: ValidationError) -> str:
    """One line naming every invalid key of a pydantic ValidationError (each input cut to 60 characters)."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{where[:200]}'")
        elif "input" in e and e["type"] not in ("value_error", "missing"):
            got = repr(e["input"])
            lines.append(f"{where}: {e['msg']} (got {got if len(got) <= 60 else got[:57] + '...'})")
        else:
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return _one_line("invalid config: " + "; ".join(lines))
