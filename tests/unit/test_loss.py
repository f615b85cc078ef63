"""Taking the loss out of a forward's output: tensors, mappings, objects with .loss; anything else is named."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddptrain.errors import ConfigError
from ddptrain.models.loss import extract_loss


@dataclass
class Output:
    loss: object
    logits: torch.Tensor | None = None


@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
def test_every_accepted_shape_gives_the_same_scalar(value: float) -> None:
    loss = torch.tensor(value)
    for output in (loss, {"loss": loss, "logits": torch.zeros(2)}, Output(loss)):
        assert extract_loss(output, "m") is loss


def test_transformers_model_output() -> None:
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.CausalLMOutput(loss=torch.tensor(1.5), logits=torch.zeros(1, 2, 3))
    assert extract_loss(out, "m").item() == 1.5


@pytest.mark.parametrize(
    "output, says",
    [
        (torch.zeros(4, 8, 16), "a tensor of shape (4, 8, 16)"),
        ({"logits": torch.zeros(2)}, "a mapping with keys ['logits']"),
        (Output(None, torch.zeros(1)), "Output"),
        (Output(torch.zeros(3)), "whose loss is a tensor of shape (3,)"),
        (Output(torch.tensor(3)), "whose loss is a tensor of shape ()"),  # an integer tensor is no loss
        ((torch.tensor(1.0),), "tuple"),
    ],
)
def test_anything_else_is_a_user_error_naming_model_and_output(output: object, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        extract_loss(output, "'my.mod:build'")
    assert "'my.mod:build'" in str(e.value) and says in str(e.value)
