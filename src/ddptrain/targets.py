"""Resolve 'package.module:function' strings naming the user's own factories."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ddptrain.errors import ConfigError


def import_target(target: str, key: str) -> Callable[..., Any]:
    """Resolve 'pkg.module:attr' to the callable it names."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}={target!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}={target!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}={target!r}: {module_name!r} has no callable {attr!r}")
    factory: Callable[..., Any] = fn
    return factory
