"""Data parallelism: a model wrapped in DDP, or sharded with FSDP2 (called once by the run's set-up, on every rank).

dist.strategy ddp wraps in DistributedDataParallel; fsdp and hsdp shard the model in place with FSDP2's
`fully_shard` on a DeviceMesh: fsdp shards every parameter, its gradient and its optimizer state over all
ranks (a 1-D mesh); hsdp shards within groups of dist.shard_size ranks and replicates across the groups (a
2-D mesh, (replicate, shard)). Each shard unit (a transformer block) is sharded on its own, then the root
takes the parameters left over: a unit's parameters are all-gathered just before its forward and
backward and freed after, so a rank holds the full parameters of about one unit at a time.

`fully_shard` changes the module's class in place and turns its parameters into DTensors: the
user's module stays the module the trainer holds (no wrapper), and `unwrap_model` returns it.

DDP's full optimizer state under FSDP (`by_name`): a DDP run saves `optimizer.state_dict()`, keyed by
parameter index; FSDP's set_optimizer_state_dict takes state keyed by parameter name (FQN). Both runs build
the optimizer over the same parameters in the same order (train/optim.py), so index k is the k-th parameter
of the param groups, in order.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._composable.checkpoint_activation import checkpoint
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import Config
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError
from ddptrain.models.gpt import Block
from ddptrain.train.optim import load_optimizer_state


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


def shard_units(model: nn.Module, cfg: Config) -> list[nn.Module]:
    """The submodules that become one FSDP unit each (and one activation checkpoint each).

    model.shard_units (class names) wins; else the built-in GPT's blocks, or the classes a transformers
    model declares in `_no_split_modules` (its decoder layers). A user's model must name them.
    """
    names = set(cfg.model.shard_units)
    if not names:
        hf = getattr(model, "hf", None)
        declared = getattr(hf, "_no_split_modules", None) if hf is not None else None
        if declared:
            names = set(declared)
        elif any(isinstance(m, Block) for m in model.modules()):
            names = {Block.__name__}
        else:
            raise ConfigError(
                f"cannot tell which submodules of {type(model).__name__} to shard or checkpoint: set model.shard_units "
                "to the class names of its repeated blocks (e.g. [MyBlock])"
            )
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not units:
        found = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"model.shard_units {sorted(names)} match no submodule of {type(model).__name__}; "
            f"its classes are {', '.join(found)}"
        )
    return units


def device_mesh(cfg: Config, ctx: DistContext) -> DeviceMesh:
    """The mesh FSDP2 shards over: the training group itself (fsdp), or (replicate, shard) groups (hsdp).

    Collectives: none for fsdp (the training group is reused); hsdp creates the groups of both mesh
    dimensions (new_group on every rank, in the same order).
    """
    if cfg.dist.strategy == "fsdp":
        return DeviceMesh.from_group(ctx.group, ctx.device.type)  # type: ignore[arg-type]  # distributed: a group exists
    shard = cfg.dist.shard_size or ctx.world_size
    cfg.check_world_size(ctx.world_size)  # checked before any rendezvous too (run.distributed)
    return init_device_mesh(ctx.device.type, (ctx.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # dist.grad_compression under FSDP: the reduce dtype


def mixed_precision(precision: str, compression: str = "none") -> MixedPrecisionPolicy:
    """bf16: parameters all-gathered and computed in bf16, gradients reduced in fp32 (fp32 master copies).
    dist.grad_compression fp16/bf16: gradients reduce-scattered (and, hsdp, all-reduced across replicas) in it."""
    reduce_dtype = REDUCE_DTYPES.get(compression, torch.float32)
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    # fp32 (fp16 is refused by the config with a sharded strategy)
    return MixedPrecisionPolicy(reduce_dtype=reduce_dtype if compression in REDUCE_DTYPES else None)


def shard_model(model: nn.Module, cfg: Config, ctx: DistContext) -> nn.Module:
    """fully_shard each shard unit, then the root; returns `model` itself, now an FSDPModule.

    Every rank built the same parameters from the same seed, so each keeps its slice of them: no
    broadcast is needed (unlike DDP's). Collectives: the mesh's (hsdp only).
    """
    if ctx.device.type == "cpu" and cfg.dist.cpu_release_memory:
        _fixed_mmap_threshold()
    mesh = device_mesh(cfg, ctx)
    policy = mixed_precision(cfg.train.precision, cfg.dist.grad_compression)
    for unit in shard_units(model, cfg):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _fixed_mmap_threshold() -> None:
    """Have glibc's malloc return FSDP's freed gather and reduce buffers to the system.

    By default glibc raises its mmap threshold (up to 32 MB) each time a large block is freed, after
    which blocks of a unit's size come from the heap and stay in the process: measured on 2 CPU ranks
    with an 85M-parameter GPT, the max RSS grew every step to 1.3x DDP's; with the threshold fixed at
    1 MiB it stayed at 0.66x. Setting it (mallopt M_MMAP_THRESHOLD) turns the dynamic rule off. The
    price is fresh pages for every gathered unit: steps up to ~2.8x slower (a 57M GPT, 2 loaded
    cores), hence opt-in (dist.cpu_release_memory). No-op where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3  # glibc's malloc.h
    mallopt(m_mmap_threshold, 1 << 20)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2: whether this backward reduce-scatters gradients (off for all micro-batches but the last)."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if isinstance(inner, FSDPModule):
        inner.set_requires_gradient_sync(enabled)


def local_norm(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s total norm as a plain tensor: a DTensor under FSDP2 becomes its full (replicated) value.

    No host read: the result stays on the device for the non-finite check.
    """
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by shard_model (its parameters are DTensors)."""
    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any], optim_state: dict[str, Any]
) -> None:
    """Restore a full (DDP or single-process) model and optimizer state; under FSDP each rank keeps its own shard."""
    if not is_sharded(model):
        model.load_state_dict(model_state)
        load_optimizer_state(optimizer, optim_state)
        return
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)


def by_name(optim_state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An index-keyed optimizer state (DDP's) keyed by parameter name instead; a named one as it is."""
    if not any(isinstance(k, int) for k in optim_state.get("state", {})) and not any(
        isinstance(p, int) for g in optim_state.get("param_groups", []) for p in g.get("params", [])
    ):
        return optim_state
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[k]: v for k, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [order[k] for k in g["params"]]} for g in optim_state["param_groups"]],
    }
