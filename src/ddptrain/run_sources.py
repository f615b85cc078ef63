"""Where the model and data of a Python-API run came from, recorded so config.yaml can rebuild them.

`ddptrain.train(model=..., datasets=...)` takes each as a live object or as a factory (a function or
class, called with model.kwargs / data.kwargs under the run's seed):

- a factory that is importable under its own name (`module:qualname` resolves back to it) is recorded
  as `model.target` / `data.target`, and built exactly as `ddptrain train` builds a target;
- a live built-in GPT (the class itself, not a subclass) is the built-in GPT: its shape goes into
  `model.*`, nothing else is needed;
- anything else (a live module or dataset, a lambda, a factory defined in `__main__` or inside a
  function) is used as given and recorded in `model.live` / `data.live` (its class): the commands that
  rebuild the model or data then exit 2 saying which key to set (models.require_model_source, and
  data/source.py's LiveDatasets).

The caller's Config is never changed: what is recorded goes into a copy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from ddptrain.config import Config
from ddptrain.data.kinds import data_source
from ddptrain.data.source import LiveData
from ddptrain.errors import ConfigError
from ddptrain.models import require_model_source
from ddptrain.models.gpt import GPT

ModelSource = nn.Module | Callable[..., nn.Module] | None
_GPT_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "dropout")


def importable_name(obj: object) -> str | None:
    """'module:qualname' when that names obj itself in an imported module other than __main__."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__":
        return None  # __main__ is the script itself: another process imports it under no such name
    found = sys.modules.get(module)
    return f"{module}:{qualname}" if found is not None and getattr(found, qualname, None) is obj else None


def _class_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def _factory_record(factory: object) -> dict[str, Any]:
    """A factory's config keys: its importable name as the target, else what it is, as live."""
    name = importable_name(factory)
    if name:
        return {"target": name, "live": None}
    return {"live": f"factory {getattr(factory, '__qualname__', repr(factory))}"}


def record_sources(cfg: Config, model: ModelSource, datasets: LiveData) -> tuple[Config, ModelSource, LiveData]:
    """A copy of cfg recording where model and datasets come from (cfg itself is left as it is), and what is
    left to build from live objects (None: the config builds it)."""
    model_keys: dict[str, Any] = {}
    data_keys: dict[str, Any] = {}
    if type(model) is GPT:  # a subclass may hold more than model.* builds: it is the user's model
        model_keys = {k: getattr(model.cfg, k) for k in _GPT_KEYS} | {"live": None}
    elif isinstance(model, nn.Module):
        model_keys = {"live": _class_name(model)}
    elif model is not None:
        model_keys = _factory_record(model)
        model = None if "target" in model_keys else model
    if isinstance(datasets, tuple):
        data_keys = {"live": ", ".join(_class_name(d) for d in datasets if d is not None)}
    elif datasets is not None:
        data_keys = _factory_record(datasets)
        datasets = None if "target" in data_keys else datasets
    if not model_keys and not data_keys:
        return cfg, model, datasets
    recorded = cfg.model_copy(
        update={"model": cfg.model.model_copy(update=model_keys), "data": cfg.data.model_copy(update=data_keys)}
    )
    return recorded, model, datasets


def settle_sources(cfg: Config, model: ModelSource, datasets: LiveData) -> tuple[Config, ModelSource, LiveData]:
    """record_sources, then a ConfigError (exit 2) when what the config must build itself cannot be built: e.g.
    `ddptrain train -c` the config.yaml of a live-object run. Idempotent: run.train and build_run both call it."""
    cfg, model, datasets = record_sources(cfg, model, datasets)
    if model is None:
        require_model_source(cfg.model)
    data_source(cfg.data, datasets).check_can_build()
    return cfg, model, datasets


def live_model(cfg: Config, model: ModelSource) -> nn.Module | None:
    """The module to train from a live source: itself, or what an unimportable factory returns (None for None)."""
    if model is None or isinstance(model, nn.Module):
        return model
    made = model(**cfg.model.kwargs)
    if not isinstance(made, nn.Module):
        raise ConfigError(
            f"the model factory given to ddptrain.train() returned {type(made).__name__}, not an nn.Module"
        )
    return made
