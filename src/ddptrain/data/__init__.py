"""Data: corpus preparation, memory-mapped token datasets and the resumable distributed sampler."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.config import Config, DataConfig
from ddptrain.errors import ConfigError
from ddptrain.targets import import_target

if TYPE_CHECKING:  # torch loads only when datasets are built: `prepare`'s workers never need it
    from torch.utils.data import Dataset


def require_data_source(cfg: DataConfig) -> None:
    """ConfigError when the config cannot rebuild its data: live datasets trained it and no data.target is set."""
    if cfg.live is not None and cfg.target is None:
        raise ConfigError(
            f"data.live={cfg.live!r}: the run trained on live datasets passed to ddptrain.train(), which ddptrain "
            "cannot rebuild; add data.target=pkg.module:factory (returning (train, val)), "
            "or data.live=null data.dir=DIR for a prepared corpus"
        )


def build_datasets(cfg: Config) -> tuple[Dataset[Any], Dataset[Any] | None]:
    """(train, val) from the user's factory (data.target) or the prepared corpus in data.dir."""
    from torch.utils.data import Dataset

    from ddptrain.data.dataset import load_token_datasets

    require_data_source(cfg.data)
    if cfg.data.target is None:
        # The built-in GPT's vocabulary was fitted to the data's (models.fit_vocab_to_data) before this.
        return load_token_datasets(Path(cfg.data.dir), cfg.model.block_size)
    made = import_target(cfg.data.target, "data.target")(**cfg.data.kwargs)
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], Dataset)):
        raise ConfigError(f"data.target={cfg.data.target!r} must return (train_dataset, val_dataset_or_None)")
    return made
