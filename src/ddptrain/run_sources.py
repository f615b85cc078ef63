"""Where the model and data of a Python-API run came from, recorded so config.yaml can rebuild them.

`ddptrain.train(model=..., datasets=...)` takes each as a live object or as a factory (a function or
class, called with model.kwargs / data.kwargs under the run's seed):

- a factory that is importable under its own name (`module:qualname` resolves back to it) is recorded
  as `model.target` / `data.target`, and built exactly as `ddptrain train` builds a target;
- a live built-in GPT is the built-in GPT: its shape goes into `model.*`, nothing else is needed;
- anything else (a live module or dataset, a lambda, a factory defined in `__main__` or inside a
  function) is used as given and recorded in `model.live` / `data.live` (its class): the commands that
  rebuild the model or data then exit 2 saying which key to set (models.require_model_source,
  data.require_data_source).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.utils.data import Dataset

from ddptrain.config import Config
from ddptrain.data import require_data_source
from ddptrain.errors import ConfigError
from ddptrain.models import require_model_source
from ddptrain.models.gpt import GPT

Datasets = tuple[Dataset[Any], Dataset[Any] | None]
ModelSource = nn.Module | Callable[..., nn.Module] | None
DataSource = Datasets | Callable[..., Datasets] | None
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


def record_sources(cfg: Config, model: ModelSource, datasets: DataSource) -> tuple[ModelSource, DataSource]:
    """Record in cfg where model and datasets come from; returns what is left to build (None: the config builds it)."""
    if isinstance(model, GPT):
        cfg.model = cfg.model.model_copy(update={k: getattr(model.cfg, k) for k in _GPT_KEYS} | {"live": None})
    elif isinstance(model, nn.Module):
        cfg.model.live = _class_name(model)
    elif model is not None:
        name = importable_name(model)
        cfg.model.live = None if name else f"factory {getattr(model, '__qualname__', repr(model))}"
        if name:
            cfg.model.target, model = name, None
    if isinstance(datasets, tuple):
        cfg.data.live = ", ".join(_class_name(d) for d in datasets if d is not None)
    elif datasets is not None:
        name = importable_name(datasets)
        cfg.data.live = None if name else f"factory {getattr(datasets, '__qualname__', repr(datasets))}"
        if name:
            cfg.data.target, datasets = name, None
    return model, datasets


def settle_sources(cfg: Config, model: ModelSource, datasets: DataSource) -> tuple[ModelSource, DataSource]:
    """record_sources, then a ConfigError (exit 2) when what cfg must build itself cannot be built: e.g.
    `ddptrain train -c` the config.yaml of a live-object run. Idempotent: run.train and build_run both call it."""
    model, datasets = record_sources(cfg, model, datasets)
    if model is None:
        require_model_source(cfg.model)
    if datasets is None:
        require_data_source(cfg.data)
    return model, datasets


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


def live_datasets(cfg: Config, datasets: DataSource) -> Datasets | None:
    """The (train, val) from a live source: itself, or what an unimportable factory returns (None for None)."""
    if datasets is None or isinstance(datasets, tuple):
        return datasets
    made = datasets(**cfg.data.kwargs)
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], Dataset)):
        raise ConfigError(
            "the datasets factory given to ddptrain.train() must return (train_dataset, val_dataset_or_None)"
        )
    return made
