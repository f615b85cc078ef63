"""Models: the built-in GPT and the protocol for bringing your own.

The user-model protocol
-----------------------
`model.target: "my_pkg.mod:build_model"` names a factory called as `build_model(**model.kwargs)`
that returns an `nn.Module`. Each batch from your dataset is passed to it as `model(*batch)` (a
tuple or list) or `model(**batch)` (a dict), and `forward` returns the scalar mean loss of that
batch. Optionally the module has `flops_per_token()` (for MFU) and the train dataset a
`tokens_per_sample` attribute (for tokens/s).

`data.target: "my_pkg.mod:build_datasets"` names a factory called as
`build_datasets(**data.kwargs)` returning `(train_dataset, val_dataset_or_None)`: map-style
`torch.utils.data.Dataset`s whose items the default collate can batch.
"""

from __future__ import annotations

import torch.nn as nn

from ddptrain.config import ModelConfig
from ddptrain.errors import ConfigError
from ddptrain.models.gpt import GPT
from ddptrain.targets import import_target


def build_model(cfg: ModelConfig) -> nn.Module:
    """The built-in GPT, or the module returned by the user's factory."""
    if cfg.target is None:
        return GPT(cfg)
    model = import_target(cfg.target, "model.target")(**cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.target={cfg.target!r} returned {type(model).__name__}, not an nn.Module")
    return model
