"""Wrapping a model for data-parallel training (called once by the run's set-up, on every rank).

dist.strategy ddp wraps in DistributedDataParallel; fsdp and hsdp shard the model in place
(train/sharding.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._composable.checkpoint_activation import checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import Config
from ddptrain.dist import DistContext
from ddptrain.train.sharding import shard_model, shard_units


def wrap_model(model: nn.Module, cfg: Config, ctx: DistContext) -> nn.Module:
    """The module the training step calls: DDP around `model` (or `model` sharded) when distributed, compiled when asked.

    Collectives: DDP's constructor broadcasts rank 0's parameters and buffers to every rank; hsdp
    creates its mesh's groups.
    """
    model = model.to(ctx.device)
    t = cfg.train
    if t.activation_checkpointing != "none":
        # Before wrapping, so that DDP and FSDP see the recomputing units; the composable form
        # keeps parameter names (and so checkpoints) unchanged.
        every = t.activation_checkpointing_every if t.activation_checkpointing == "every_n" else 1
        for unit in shard_units(model, cfg)[::every]:
            checkpoint(unit)
    wrapped: nn.Module = model
    if ctx.is_distributed and cfg.dist.strategy != "ddp":
        wrapped = shard_model(model, cfg, ctx)
    elif ctx.is_distributed:
        d = cfg.dist
        # DDP all-reduces each gradient bucket as soon as backward has filled it, so the
        # communication of late layers overlaps the backward of early ones.
        wrapped = DDP(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            process_group=ctx.group,
            bucket_cap_mb=d.bucket_cap_mb,
            static_graph=d.static_graph,
            gradient_as_bucket_view=d.gradient_as_bucket_view,
            find_unused_parameters=d.find_unused_parameters,
        )
    if cfg.train.compile:
        wrapped = torch.compile(wrapped)  # type: ignore[assignment]  # compiling the DDP wrapper keeps bucketed overlap
    return wrapped


def unwrap_model(wrapped: nn.Module) -> nn.Module:
    """The user's module inside DDP and torch.compile wrappers (whose state_dict has no prefixes).

    A sharded module is the user's own object (fully_shard changes its class in place).
    """
    inner = getattr(wrapped, "_orig_mod", wrapped)  # torch.compile's OptimizedModule
    return inner.module if isinstance(inner, DDP) else inner
