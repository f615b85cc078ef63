"""Resolve 'package.module:function' strings naming the user's own factories.

A module of the user's own is found as `python -m` finds it: on sys.path, else in the current folder
(the `ddptrain` console script, unlike `python -m ddptrain`, does not put the current folder on
sys.path; it is tried last, after every installed module, so it never shadows one).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ddptrain.errors import ConfigError


def _import(module_name: str) -> Any:
    """The module, looked up on sys.path and then in the current folder; ImportError when neither has it."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.partition(".")[0]
        here = os.getcwd()
        if e.name != top or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as again:
            if again.name == top:  # not here either: sys.path as it was
                sys.path.remove(here)
            raise


def import_target(target: str, key: str) -> Callable[..., Any]:
    """Resolve 'pkg.module:attr' to the callable it names; ConfigError in one line saying how to make a module of
    the user's own importable when it is not found."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}={target!r} must look like 'package.module:function'")
    try:
        module = _import(module_name)
    except ModuleNotFoundError as e:
        top = module_name.partition(".")[0]
        if e.name != top:
            raise ConfigError(f"{key}={target!r}: cannot import {module_name!r} ({e})") from None
        raise ConfigError(
            f"{key}={target!r}: cannot import {module_name!r}: no module {top!r} on the Python path or in the "
            f"current folder; run from the folder "
            f"holding {top}.py (or {top}/), or add that folder to PYTHONPATH (e.g. PYTHONPATH=path/to/it ddptrain ...)"
        ) from None
    except ImportError as e:
        raise ConfigError(f"{key}={target!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}={target!r}: {module_name!r} has no callable {attr!r}")
    factory: Callable[..., Any] = fn
    return factory
