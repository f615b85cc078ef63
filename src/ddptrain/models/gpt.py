"""The built-in GPT: a small decoder-only transformer with causal SDPA attention."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddptrain.config import ModelConfig
from ddptrain.data.collate import IGNORE_INDEX
from ddptrain.errors import DataError


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # SDPA picks the fused flash / memory-efficient kernel where the device has one.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        out: torch.Tensor = self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """forward(idx, targets) -> mean cross-entropy loss; the user-model protocol's contract."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position of idx (B, T)."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits

    def forward(
        self,
        idx: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean cross-entropy over the positions whose target is not IGNORE_INDEX.

        (idx, targets): the corpus's windows, targets already shifted by one. (input_ids=, labels=,
        attention_mask=): a padded batch (data.collate=pad), labels aligned with input_ids as in
        transformers, so they are shifted here. The mask is not needed: attention is causal and the
        padding on the right, so no real token attends to a pad, and a pad's label is IGNORE_INDEX.
        """
        idx, targets = shifted_pair(idx, targets, input_ids, labels, self.cfg.block_size)
        logits = self.logits(idx)
        flat = logits.float().view(-1, logits.size(-1))
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position embedding (tied wte counts once)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N plus attention 12*L*H*Q*T (PaLM paper, appendix B)."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * c.block_size

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Sample max_new_tokens continuations of idx (B, T)."""
        for _ in range(max_new_tokens):
            logits = self.logits(idx[:, -self.cfg.block_size :])[:, -1, :] / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


def shifted_pair(
    idx: torch.Tensor | None,
    targets: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    labels: torch.Tensor | None,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token targets) from a window pair or from a padded batch's input_ids and labels.

    DataError (exit 2) when the arguments are neither, or a padded batch is longer than block_size + 1
    tokens: data.collate=pad pads to the longest sample, which the position embedding must cover.
    """
    if input_ids is not None and labels is not None and idx is None and targets is None:
        if input_ids.shape[1] > block_size + 1:
            raise DataError(
                f"a padded batch of {input_ids.shape[1]} tokens exceeds model.block_size + 1 ({block_size + 1}); "
                "truncate the samples or raise model.block_size"
            )
        return input_ids[:, :-1], labels[:, 1:]
    if idx is not None and targets is not None and input_ids is None and labels is None:
        return idx, targets
    raise DataError(
        "the model takes (inputs, targets) windows or input_ids= and labels= (data.collate=pad); a batch gave neither"
    )
