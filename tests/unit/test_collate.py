"""data.collate: the built-in padding collate, and how each batch shape reaches forward."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import call_model
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate
from varlen_toy import VarLenTokens

from ddptrain.config import DataConfig, ModelConfig
from ddptrain.data.collate import IGNORE_INDEX, build_collate, pad_collate
from ddptrain.data.identity import datasets_identity
from ddptrain.data.kinds import data_source
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError, DataError
from ddptrain.models.gpt import GPT
from ddptrain.train.evaluation import evaluate_loss


def test_pad_collate_pads_right_and_masks_the_padding() -> None:
    batch = pad_collate([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=3)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 3, 3]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_pad_collate_keeps_given_labels_and_batches_other_keys() -> None:
    samples = [
        {"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX, 2, 3], "id": 7},
        {"input_ids": torch.tensor([4, 5]), "id": 9},
    ]
    batch = pad_collate(samples)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]  # pad id 0 unless given
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 2, 3], [4, 5, IGNORE_INDEX]]
    assert batch["id"].tolist() == [7, 9]


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([torch.zeros(2, 3, dtype=torch.long)], "sample 0's input_ids is not a 1-D integer sequence"),
        ([torch.tensor([1]), torch.tensor([0.5, 1.0])], "sample 1's input_ids is not a 1-D integer sequence"),
        ([{"text": "hi"}], "sample 0 of the batch has no 'input_ids'"),
        ([{"input_ids": [1, 2], "labels": [1]}], "sample 0's labels has 1 entries, its input_ids 2"),
    ],
)
def test_pad_collate_refuses_what_is_not_token_rows(samples: list[Any], message: str) -> None:
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        pad_collate(samples)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=6), st.integers(0, 50))
def test_pad_collate_over_random_lengths(lengths: list[int], pad_id: int) -> None:
    samples = [torch.arange(100, 100 + n) for n in lengths]
    batch = pad_collate(samples, pad_id=pad_id)
    assert batch["input_ids"].shape == (len(lengths), max(lengths))
    for row, n in enumerate(lengths):
        assert batch["input_ids"][row, :n].tolist() == samples[row].tolist()
        assert (batch["input_ids"][row, n:] == pad_id).all()
        assert batch["labels"][row, :n].tolist() == samples[row].tolist()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].sum() == n and batch["attention_mask"][row, :n].all()


def test_build_collate_resolves_each_form() -> None:
    assert build_collate(DataConfig(), lambda: 0) is default_collate
    pad = build_collate(DataConfig(collate="pad", target="varlen_toy:varlen_datasets"), lambda: 0)
    assert pad([torch.tensor([1]), torch.tensor([1, 2])])["input_ids"].tolist() == [[1, 0], [1, 2]]
    assert build_collate(DataConfig(collate="ddptrain.data.collate:pad_collate"), lambda: 0) is pad_collate
    with pytest.raises(ConfigError, match="data.collate='no_such_module:f': cannot import"):
        build_collate(DataConfig(collate="no_such_module:f"), lambda: 0)


def test_the_pad_id_is_the_corpus_tokenizers_end_of_document(corpus_dir: Any) -> None:
    assert data_source(DataConfig(target="varlen_toy:varlen_datasets")).pad_id() == 0  # no tokenizer ddptrain knows
    assert data_source(DataConfig(dir=str(corpus_dir))).pad_id() == 0  # bytes: no end-of-document id


def test_the_built_in_gpt_ignores_padded_positions() -> None:
    torch.manual_seed(0)
    gpt = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.0)).eval()
    long, short = torch.randint(0, 32, (9,)), torch.randint(0, 32, (4,))
    padded = call_model(gpt, pad_collate([long, short], pad_id=31), "gpt")
    # The padded batch's loss is the mean over the real next-token targets of both samples alone.
    losses = [F.cross_entropy(gpt.logits(s[None, :-1])[0], s[1:], reduction="sum") for s in (long, short)]
    assert torch.allclose(padded, sum(losses) / (8 + 3), atol=1e-5)
    with pytest.raises(DataError, match="exceeds model.block_size"):
        gpt(**pad_collate([torch.zeros(10, dtype=torch.long)]))


class Echo(nn.Module):
    """Returns a loss that says how forward was called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, list[str]]] = []

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        self.calls.append((len(args), sorted(kwargs)))
        return torch.tensor(0.0)


def test_each_batch_shape_reaches_forward_by_the_protocols_rule() -> None:
    model = Echo()
    samples = [torch.ones(3) for _ in range(17)]
    call_model(model, default_collate(samples), "echo")  # a tensor: one argument, however many samples
    call_model(model, default_collate([(s, s) for s in samples]), "echo")  # a tuple (here a list): positional
    call_model(model, default_collate([{"x": s, "y": s} for s in samples]), "echo")  # a mapping: keywords
    assert model.calls == [(1, []), (2, []), (0, ["x", "y"])]


def test_variable_length_samples_have_a_data_identity() -> None:
    a, b = VarLenTokens(10, 32, 1, 9, seed=0), VarLenTokens(10, 32, 1, 9, seed=2)
    assert datasets_identity(a, a) == datasets_identity(VarLenTokens(10, 32, 1, 9, seed=0), a)
    assert datasets_identity(a, None)["fingerprint"] != datasets_identity(b, None)["fingerprint"]


def test_a_padded_val_loss_is_the_mean_over_tokens_however_samples_are_grouped() -> None:
    torch.manual_seed(0)
    gpt = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=32, dropout=0.0))
    data = VarLenTokens(10, 32, 1, 17, seed=3)  # lengths from 1: some samples have no target at all
    collate = functools.partial(pad_collate, pad_id=0)

    def forward(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return call_model(model, batch, "gpt"), {}

    results = [evaluate_loss(gpt, data, 10, micro, DistContext(), forward, collate) for micro in (1, 3, 10)]
    by_micro = [r.loss if r is not None else None for r in results]
    assert by_micro[0] is not None and by_micro[1:] == pytest.approx([by_micro[0]] * 2, abs=1e-6)
