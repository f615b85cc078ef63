"""Data: corpus preparation, memory-mapped token datasets and the resumable distributed sampler."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.config import Config
from ddptrain.errors import ConfigError
from ddptrain.targets import import_target

if TYPE_CHECKING:  # torch loads only when datasets are built: `prepare`'s workers never need it
    from torch.utils.data import Dataset


def build_datasets(cfg: Config) -> tuple[Dataset[Any], Dataset[Any] | None]:
    """(train, val) from the user's factory (data.target) or the prepared corpus in data.dir."""
    from torch.utils.data import Dataset

    from ddptrain.data.dataset import load_token_datasets

    if cfg.data.target is None:
        # The built-in GPT's vocabulary was fitted to the data's (models.fit_vocab_to_data) before this.
        return load_token_datasets(Path(cfg.data.dir), cfg.model.block_size)
    made = import_target(cfg.data.target, "data.target")(**cfg.data.kwargs)
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], Dataset)):
        raise ConfigError(f"data.target={cfg.data.target!r} must return (train_dataset, val_dataset_or_None)")
    return made
