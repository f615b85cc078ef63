"""The built-in GPT: shapes, initial loss, FLOPs per token by hand."""

from __future__ import annotations

import math

import torch

from ddptrain.config import ModelConfig
from ddptrain.models.gpt import GPT


def test_initial_loss_is_near_uniform_and_generate_extends() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    idx, targets = torch.randint(0, 256, (3, 16)), torch.randint(0, 256, (3, 16))
    loss = model(idx, targets)
    assert abs(loss.item() - math.log(256)) < 0.3
    out = model.generate(idx[:, :4], max_new_tokens=20, top_k=5)
    assert out.shape == (3, 24)


def test_flops_per_token_by_hand() -> None:
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256)
    model = GPT(cfg)
    # Non-embedding parameters: per block 2 LayerNorms (no bias) + qkv + proj + MLP; final LN; tied wte.
    per_block = 2 * 64 + 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64
    n = 2 * per_block + 64 + 256 * 64
    assert model.num_params() == n
    assert model.flops_per_token() == 6 * n + 12 * 2 * 64 * 32
