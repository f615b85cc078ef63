"""Models returning their loss in other shapes than a scalar tensor (model.target factories for tests)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyLM(nn.Module):
    """An embedding and a linear head; forward's output shape is chosen by `returns`."""

    def __init__(self, returns: str, vocab_size: int = 256, width: int = 32) -> None:
        super().__init__()
        self.returns = returns
        self.emb = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> object:
        logits = self.head(self.emb(idx))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        if self.returns == "dict":
            return {"loss": loss, "logits": logits}
        return logits  # "logits": the mistake the trainer must name


def build(returns: str) -> nn.Module:
    return TinyLM(returns)
