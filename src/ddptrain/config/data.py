"""The data section: the prepared corpus, a user factory, batching."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ddptrain.config.base import LineText, Section


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
    micro_batch_size: int = Field(16, ge=1, description="Samples per rank per forward pass.")
    num_workers: int = Field(
        0, ge=0, description="DataLoader worker processes per rank (0 loads in the training process)."
    )
    val_fraction: float = Field(
        0.05, gt=0.0, lt=0.5, description="Share of the corpus held out for validation by `ddptrain prepare`."
    )
