"""Take the loss out of whatever a model's forward returned.

Accepted: a scalar tensor, a mapping with a "loss" entry, or an object with a `.loss`
attribute (a Hugging Face `ModelOutput`). Anything else is a user error naming the model and
what it returned, so a model returning logits fails with one line instead of a traceback deep
in the training step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddptrain.errors import ConfigError


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a mapping with keys {sorted(map(str, value))[:6]} and no usable 'loss'"
    return f"{type(value).__name__}"


def extract_loss(output: Any, model_name: str) -> torch.Tensor:
    """The scalar loss tensor in a forward's output; ConfigError naming model_name otherwise."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, torch.Tensor):
        loss = output
    else:
        loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return loss
    got = _describe(output)
    if loss is not None and loss is not output:
        got += f" whose loss is {_describe(loss)}"
    raise ConfigError(
        f"model {model_name} returned {got}; forward must return a scalar loss tensor, "
        "a mapping with 'loss', or an object with .loss"
    )


def model_name(model: torch.nn.Module, target: str | None) -> str:
    """How error messages name the model: its target string, or its class."""
    return repr(target) if target else type(model).__name__


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch (a tensor, or a mapping/list/tuple of them) on device; a mapping arrives as a dict."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def model_output(model: torch.nn.Module, batch: Any) -> Any:
    """What forward returns for one batch under the user-model protocol: a tensor is forward's one argument, a
    mapping its keywords, a tuple or list its positional arguments (anything else: one argument)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)  # a tensor: unpacking it would pass each sample of the batch as an argument of its own
