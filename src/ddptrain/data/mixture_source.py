"""data.sources: a weighted mixture of sources of the other kinds, trained as one stream (data/mixture.py).

Each entry is a source of its own (a prepared corpus in `dir`, or a factory in `target`), built by
the same rule as data.dir / data.target. The mixture prepares its parts, checks they share one
vocabulary, trains on their weighted stream and evaluates on all their validation sets together (val_loss), and
on each one alone (val_loss/<name>).
Its identity is its parts' (names, weights and each part's identity): ranks given different weights
stop before the first step, and a resume with other weights is refused, since the stream's positions
would then name other samples.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from ddptrain.config import DataConfig
from ddptrain.config.data import MixtureSourceConfig
from ddptrain.data.mixture import MixtureDataset, MixturePart, MixtureValidation
from ddptrain.data.source import Datasets, DataSource, LiveData, Sampling
from ddptrain.data.tokenizer import Tokenizer
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError

MakeSource = Callable[[DataConfig], DataSource]


class Mixture(DataSource):
    """The sources data.sources lists, each with its weight."""

    kind = "mixture"
    key = "data.sources"

    def __init__(self, cfg: DataConfig, parts: list[tuple[MixtureSourceConfig, DataSource]]) -> None:
        super().__init__(cfg)
        self.parts = parts

    @classmethod
    def build(cls, cfg: DataConfig, live: LiveData, make: MakeSource) -> DataSource:
        """Each entry of data.sources made into a source by `make` (data_source: the same rules as data.dir
        and data.target)."""
        return cls(cfg, [(entry, make(_part_config(cfg, entry))) for entry in cfg.sources])

    @classmethod
    def claims(cls, cfg: DataConfig, live: LiveData) -> bool:
        """data.sources lists at least one source (and no live datasets were given)."""
        return bool(cfg.sources) and live is None

    def prepare(self, ctx: DistContext, wait_s: float) -> None:
        """Each part prepares itself, in the listed order (the same collectives on every rank)."""
        for _, part in self.parts:
            part.prepare(ctx, wait_s)

    def datasets(self, sampling: Sampling) -> Datasets:
        """The weighted stream of the parts' training sets; their validation sets one after another, each known
        by its source's name (the trainer logs each one's loss too)."""
        trains: list[MixturePart] = []
        vals: list[tuple[str, Dataset[Any]]] = []
        for entry, part in self.parts:
            train, val = part.datasets(sampling)
            trains.append(MixturePart(entry.name, train, entry.weight))
            if val is not None:
                vals.append((entry.name, val))
        mixed = MixtureDataset(trains, sampling.global_batch, sampling.seed)
        return mixed, (MixtureValidation(vals) if vals else None)

    def vocab_size(self) -> int | None:
        """The parts' one vocabulary (None when none of them knows it); ConfigError when they differ."""
        sizes = {entry.name: part.vocab_size() for entry, part in self.parts}
        known = {size for size in sizes.values() if size is not None}
        if len(known) > 1:
            listed = ", ".join(f"{name} {size}" for name, size in sizes.items() if size is not None)
            raise ConfigError(f"data.sources have different vocabularies ({listed}): a mixture needs one tokenizer")
        return known.pop() if known else None

    def tokenizer(self) -> Tokenizer | None:
        """The first part's that has one (vocab_size() checked they agree)."""
        return next((t for _, part in self.parts if (t := part.tokenizer()) is not None), None)

    def tokenizer_dir(self) -> Path | None:
        """The first prepared corpus among the parts."""
        return next((d for _, part in self.parts if (d := part.tokenizer_dir()) is not None), None)

    def pad_id(self) -> int:
        """The first part's (the parts share their tokenizer)."""
        return self.parts[0][1].pad_id()

    def verify(self) -> None:
        """Every part's bytes."""
        for _, part in self.parts:
            part.verify()

    def identity(self, train: Dataset[Any], val: Dataset[Any] | None) -> dict[str, Any]:
        """Names, weights and each part's identity (of its own datasets)."""
        assert isinstance(train, MixtureDataset)
        return {
            "mixture": [
                {"name": entry.name, "weight": entry.weight, **part.identity(mixed.dataset, None)}
                for (entry, part), mixed in zip(self.parts, train.parts)
            ]
        }

    def resume_identity(self) -> dict[str, Any]:
        """Names, weights and each part's resume identity: other weights would make the saved position name
        other samples."""
        parts = [{"name": e.name, "weight": e.weight, **part.resume_identity()} for e, part in self.parts]
        return {"source": "mixture", "parts": parts}

    def describe(self) -> str:
        """The parts and their weights."""
        return ", ".join(f"{entry.name} ({entry.weight:g})" for entry, _ in self.parts)

    def folder(self) -> Path | None:
        """The first part's folder (a batch job checks it exists before it starts)."""
        return next((f for _, part in self.parts if (f := part.folder()) is not None), None)


def _part_config(cfg: DataConfig, entry: MixtureSourceConfig) -> DataConfig:
    """The data section one part would have on its own."""
    update: dict[str, Any] = {"sources": [], "target": entry.target, "kwargs": entry.kwargs, "live": None}
    if entry.dir is not None:
        update["dir"] = entry.dir
    return cfg.model_copy(update=update)
