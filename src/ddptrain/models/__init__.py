"""Models: the built-in GPT, Hugging Face transformers models, and the protocol for bringing your own.

The user-model protocol
-----------------------
`model.target: "my_pkg.mod:build_model"` names a factory called as `build_model(**model.kwargs)`
that returns an `nn.Module`. Each batch from your dataset is passed to it as `model(*batch)` (a
tuple or list) or `model(**batch)` (a dict), and `forward` returns the loss of that batch: a
scalar tensor, a mapping with a "loss" entry, or an object with `.loss` (a transformers
`ModelOutput`). Optionally the module has `flops_per_token()` (for MFU) and the train dataset a
`tokens_per_sample` attribute (for tokens/s).

`data.target: "my_pkg.mod:build_datasets"` names a factory called as
`build_datasets(**data.kwargs)` returning `(train_dataset, val_dataset_or_None)`: map-style
`torch.utils.data.Dataset`s whose items data.collate batches (a training set may be an
IterableDataset: data/stream.py).

`model.hf` builds a transformers causal LM instead (models/hf.py). `model.live` / `data.live` record
that `ddptrain.train()` was given live objects: nothing here can rebuild those (run_sources.py).
"""

from __future__ import annotations

import torch.nn as nn

from ddptrain.config import ModelConfig
from ddptrain.errors import ConfigError, DataError
from ddptrain.models.gpt import GPT
from ddptrain.targets import import_target


def fit_vocab_to_data(cfg: ModelConfig, data_vocab: int | None) -> ModelConfig:
    """The built-in GPT's config with the data's vocabulary size, unless model.vocab_size was set (and fits)."""
    if data_vocab is None or cfg.target is not None or cfg.hf is not None:
        return cfg
    if "vocab_size" not in cfg.model_fields_set:
        return cfg.model_copy(update={"vocab_size": data_vocab})
    if cfg.vocab_size < data_vocab:
        raise DataError(f"model.vocab_size={cfg.vocab_size} is smaller than the data's vocabulary ({data_vocab})")
    return cfg


def require_model_source(cfg: ModelConfig) -> None:
    """ConfigError when the config cannot rebuild its model: a live nn.Module trained it and no model.target is set."""
    if cfg.live is not None and cfg.target is None and cfg.hf is None:
        raise ConfigError(
            f"model.live={cfg.live!r}: the run trained a live nn.Module passed to ddptrain.train(), which ddptrain "
            "cannot rebuild; add model.target=pkg.module:factory (and model.kwargs={...}) naming a factory that builds it"
        )


def check_model_config(cfg: ModelConfig) -> None:
    """What can be refused of the model's config before a run writes anything: model.hf's model_type and the keys
    of an inline model.hf.config (models/hf.py)."""
    if cfg.hf is not None:
        from ddptrain.models.hf import check_hf_config

        check_hf_config(cfg.hf)


def build_model(cfg: ModelConfig, data_vocab: int | None = None) -> nn.Module:
    """The built-in GPT, a transformers model (model.hf), or the module returned by the user's factory."""
    require_model_source(cfg)
    if cfg.hf is not None:
        from ddptrain.models.hf import build_hf_model

        model = build_hf_model(cfg.hf, cfg.block_size)
        if data_vocab is not None and model.vocab_size < data_vocab:
            raise DataError(
                f"model.hf has a vocabulary of {model.vocab_size}, smaller than the data's ({data_vocab}); "
                "prepare the data with the model's tokenizer or raise vocab_size"
            )
        return model
    if cfg.target is None:
        return GPT(cfg)
    model = import_target(cfg.target, "model.target")(**cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.target={cfg.target!r} returned {type(model).__name__}, not an nn.Module")
    return model
