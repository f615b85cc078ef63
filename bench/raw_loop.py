"""A minimal hand-written DDP training loop: the reference ddptrain's Trainer is measured against.

Same model class, dataset, sample order (ddptrain's sampler, so that the losses can be compared
bit for bit), optimizer groups, schedule and clipping as the Trainer; nothing else.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ddptrain.config import Config
from ddptrain.data.dataset import load_split
from ddptrain.data.sampler import ResumableDistributedSampler
from ddptrain.models.gpt import GPT


def make_optimizer(model: torch.nn.Module, cfg: Config) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """Fused AdamW (decay on matrices only, as the Trainer's on CPU) with linear warm-up and cosine decay, per step."""
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=t.betas,
        fused=True,
    )

    def schedule(s: int) -> float:
        if s < t.warmup_steps:
            return (s + 1) / t.warmup_steps
        p = min(1.0, (s - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


class RawLoop:
    """Plain DDP: forward, backward, clip, AdamW step, LR schedule; the loss all-reduced every log step."""

    def __init__(self, cfg: Config) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        t = cfg.train
        assert t.global_batch_size == cfg.data.micro_batch_size * world, "the raw loop has no accumulation"
        dataset = load_split(Path(cfg.data.dir), "train", cfg.model.block_size)
        torch.manual_seed(cfg.run.seed)
        model = GPT(cfg.model)
        self.model = DDP(model)
        self.opt, self.sched = make_optimizer(model, cfg)
        sampler = ResumableDistributedSampler(len(dataset), t.global_batch_size, rank, world, cfg.run.seed)
        self.batches = iter(DataLoader(dataset, batch_size=cfg.data.micro_batch_size, sampler=sampler))
        self.clip, self.log_every, self.rank = t.grad_clip, cfg.log.every_steps, rank
        self.step = 0
        self.losses: list[torch.Tensor] = []

    def train_step(self) -> None:
        """One optimizer step on the next batch."""
        x, y = next(self.batches)
        loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.step += 1
        self.losses.append(loss.detach())
        if self.step % self.log_every == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if self.rank == 0:
                print(f"step {self.step} loss {mean.item() / dist.get_world_size():.4f}", flush=True)
