"""A registry: the names a config key picks from, each declared once, with where its code lives.

A registry sits in the config layer, below the layers that implement its kinds (checkpoint,
observe, train), so that a config is validated against it without importing them: an entry names
its implementation as 'package.module:attribute', imported the first time the layer that uses it
asks (`load`). Config fields take a plain `str` checked by `Registry.check`, and their descriptions
(what `--help-config` and docs/configuration.md show) are written from the entries' `about`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, TypeVar


@dataclass(frozen=True)
class Kind:
    """One registered kind: its implementation ('module:attribute') and what it is, for the config's help."""

    target: str
    about: str


K = TypeVar("K", bound=Kind)


class Registry(Generic[K]):
    """Names -> kinds for the config key `key`; `also` are choices that name no kind of their own (auto)."""

    def __init__(self, key: str, what: str, kinds: Mapping[str, K], also: Mapping[str, str] | None = None) -> None:
        self.key, self.what, self._kinds, self._also = key, what, dict(kinds), dict(also or {})

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __contains__(self, name: object) -> bool:
        return name in self._kinds

    def __getitem__(self, name: str) -> K:
        return self._kinds[name]

    def __len__(self) -> int:
        return len(self._kinds)

    def items(self) -> list[tuple[str, K]]:
        """(name, kind) in registration order."""
        return list(self._kinds.items())

    @property
    def choices(self) -> list[str]:
        """Every value the config key takes: the extra choices (auto), then the registered names."""
        return [*self._also, *self._kinds]

    def check(self, value: str) -> str:
        """`value` when it is a choice; else ValueError naming every choice (the config turns it into one line)."""
        if value not in self._also and value not in self._kinds:
            shown = value if len(value) <= 40 else value[:37] + "..."
            raise ValueError(f"{shown!r} is not {self.what}: pick one of {', '.join(self.choices)}")
        return value

    def explained(self) -> str:
        """Every choice with what it is, for a field's description: "a (about a), b (about b) or c (about c)"."""
        parts = [f"{name} ({about})" for name, about in self._also.items()]
        parts += [f"{name} ({kind.about})" for name, kind in self._kinds.items()]
        return ", ".join(parts[:-1]) + f" or {parts[-1]}" if len(parts) > 1 else "".join(parts)

    def name_of(self, target: str) -> str:
        """The name registered for the implementation `target` ('module:attribute'); KeyError when none is."""
        for name, kind in self._kinds.items():
            if kind.target == target:
                return name
        raise KeyError(f"{target} is not registered in {self.key}")

    def load(self, name: str) -> Any:
        """The implementation registered as `name`, imported on first use; KeyError for an unknown name."""
        return load(self._kinds[name].target)


@cache
def load(target: str) -> Any:
    """'package.module:attribute' -> the attribute (the module imported once)."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)
