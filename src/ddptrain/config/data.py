"""The data section: the prepared corpus, a user factory, batching."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from ddptrain.config.base import LineText, Section


class MixtureSourceConfig(Section):
    name: LineText = Field(description="The source's name in logs, metrics (source_samples) and the report.")
    weight: float = Field(
        gt=0.0, description="Its share of every global batch (weights are relative: any positive scale)."
    )
    dir: LineText | None = Field(None, description="A prepared corpus folder (as data.dir).")
    target: str | None = Field(
        None, description="'pkg.module:factory' returning (train_dataset, val_dataset) (as data.target)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for target.")

    @model_validator(mode="after")
    def _one_kind(self) -> MixtureSourceConfig:
        if (self.dir is None) == (self.target is None):
            raise ValueError(f"data.sources entry {self.name!r} needs exactly one of dir and target")
        if self.kwargs and self.target is None:
            raise ValueError(f"data.sources entry {self.name!r}: kwargs apply to a target only")
        return self


class HFDataConfig(Section):
    files: list[LineText] = Field(
        min_length=1,
        description="Files, folders or globs: Parquet, Arrow, JSON Lines, or a folder saved by datasets' save_to_disk.",
    )
    split: LineText | None = Field(
        None, description="For a folder saved from a DatasetDict (several splits): the split to train on."
    )
    text_field: LineText = Field("text", description="The column (or JSON Lines field) holding the text.")
    tokenizer: LineText = Field(
        "bytes", description="As `ddptrain prepare --tokenizer`: bytes, a tokenizer.json, train:VOCAB."
    )


class DataConfig(Section):
    target: str | None = Field(
        None,
        description="'pkg.module:factory' returning (train_dataset, val_dataset); None uses the token corpus in data.dir.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the dataset factory given by target."
    )
    collate: LineText | None = Field(
        None,
        description="How samples become a batch: None stacks them (torch's default_collate); 'pad' right-pads variable-length token samples (1-D tensors, or mappings with input_ids) to input_ids, attention_mask and labels (-100 at pads), pad id the corpus tokenizer's end-of-document id, else 0; or 'pkg.module:collate' called with the list of samples.",
    )
    live: str | None = Field(
        None,
        description="Written by ddptrain.train() when given live dataset objects (their classes): eval then needs data.target (or data.live=null and data.dir), export and generate --data-dir. Leave unset.",
    )
    dir: LineText = Field(
        "data/stdlib", description="Folder holding the prepared corpus (train.bin, val.bin, meta.json)."
    )
    hf: HFDataConfig | None = Field(
        None,
        description="Hugging Face-format data read offline ({files, split, text_field, tokenizer}): prepared on first use into data.dir (set it to a folder of its own), then trained on as a prepared corpus.",
    )
    sources: list[MixtureSourceConfig] = Field(
        default_factory=list,
        description="A weighted mixture instead of one source: a list of {name, weight, dir | target, kwargs}; every global batch holds each source's share within one sample (docs/data.md). Empty: data.target or data.dir.",
    )
    micro_batch_size: int = Field(16, ge=1, description="Samples per rank per forward pass.")
    num_workers: int = Field(
        0, ge=0, description="DataLoader worker processes per rank (0 loads in the training process)."
    )
    val_fraction: float = Field(
        0.05, gt=0.0, lt=0.5, description="Share of the corpus held out for validation by `ddptrain prepare`."
    )

    @model_validator(mode="after")
    def _one_source_or_a_mixture(self) -> DataConfig:
        named = [key for key, value in (("target", self.target), ("hf", self.hf), ("sources", self.sources)) if value]
        if len(named) > 1:
            raise ValueError(f"data.{' and data.'.join(named)} all name the data: keep one")
        if self.hf is not None and self.dir == type(self).model_fields["dir"].default:
            raise ValueError(
                f"data.hf prepares its shards into data.dir: set data.dir to a folder of its own, not {self.dir}"
            )
        names = [source.name for source in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources names must differ: {', '.join(names)}")
        return self
