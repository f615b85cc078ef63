"""How a list of samples becomes one batch: `data.collate`.

Unset, torch's `default_collate` stacks the samples (every sample must have the same shape).
`data.collate: pad` is `pad_collate` for variable-length token samples, with the pad id of the run's
tokenizer; any other value names the user's own `collate(samples) -> batch` as `package.module:function`.
The training loader, the trainer's evaluation and `ddptrain eval` all batch through `build_collate`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate

from ddptrain.config import DataConfig
from ddptrain.errors import DataError
from ddptrain.targets import import_target

# The label of a position the loss skips: cross_entropy's default ignore_index, which the built-in
# models and every transformers causal LM use.
IGNORE_INDEX = -100
PAD = "pad"  # data.collate's name for pad_collate

Collate = Callable[[list[Any]], Any]


def check_collate(cfg: DataConfig) -> None:
    """ConfigError (exit 2, one line naming data.collate) when a collate target does not import or is not
    callable; run before any collective, so every rank stops alike."""
    if cfg.collate is not None and cfg.collate != PAD:
        import_target(cfg.collate, "data.collate")


def build_collate(cfg: DataConfig, pad_id: Callable[[], int]) -> Collate:
    """The function that batches this run's samples (default_collate when data.collate is unset). pad_id:
    the data source's (asked only for data.collate=pad): the prepared corpus's end-of-document id, what
    an export to transformers declares as pad_token_id; 0 for bytes and for data of unknown tokenizer."""
    if cfg.collate is None:
        return default_collate
    if cfg.collate == PAD:
        return functools.partial(pad_collate, pad_id=pad_id())
    collate: Collate = import_target(cfg.collate, "data.collate")
    return collate


def pad_collate(samples: list[Any], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad variable-length token samples to the batch's longest.

    A sample is a 1-D integer tensor of token ids, or a mapping with `input_ids` (and optionally
    `labels` and `attention_mask` of the same length; further keys are batched by default_collate).
    Returns `input_ids` (B, T) padded with pad_id, `attention_mask` (1 for a token, 0 for padding) and
    `labels`: the sample's labels (else its input ids), IGNORE_INDEX at the padded positions. Labels are
    aligned with input_ids, not shifted: the model shifts them (Hugging Face's convention).
    """
    if not samples:
        raise DataError("data.collate=pad: an empty batch")
    rows = [_as_fields(sample, i) for i, sample in enumerate(samples)]
    longest = max(len(row["input_ids"]) for row in rows)
    fills = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    batch = {key: torch.full((len(rows), longest), fill, dtype=torch.long) for key, fill in fills.items()}
    for i, row in enumerate(rows):
        for key in fills:
            batch[key][i, : len(row[key])] = row[key]
    extra = [key for key in rows[0] if key not in fills]
    for key in extra:
        batch[key] = default_collate([row[key] for row in rows])
    return batch


def _as_fields(sample: Any, index: int) -> dict[str, Any]:
    """A sample as input_ids, labels and attention_mask (1-D long tensors of one length) plus its other keys."""
    fields = dict(sample) if isinstance(sample, Mapping) else {"input_ids": sample}
    if "input_ids" not in fields:
        raise DataError(f"data.collate=pad: sample {index} of the batch has no 'input_ids' (keys {sorted(fields)})")
    ids = _token_row(fields["input_ids"], index, "input_ids")
    fields["input_ids"] = ids
    for key, default in (("labels", ids), ("attention_mask", torch.ones_like(ids))):
        row = _token_row(fields.get(key, default), index, key)
        if len(row) != len(ids):
            raise DataError(
                f"data.collate=pad: sample {index}'s {key} has {len(row)} entries, its input_ids {len(ids)}"
            )
        fields[key] = row
    return fields


def _token_row(value: Any, index: int, key: str) -> torch.Tensor:
    row = torch.as_tensor(value)
    if row.dim() != 1 or row.is_floating_point() or row.is_complex():
        raise DataError(
            f"data.collate=pad: sample {index}'s {key} is not a 1-D integer sequence "
            f"(a {row.dtype} tensor of shape {tuple(row.shape)})"
        )
    return row.long()
