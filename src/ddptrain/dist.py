"""The distributed context, read from the torchrun environment.

torchrun (TorchElastic) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT for every worker. With none of them set we run as one plain process and create no
process group at all, so the same code runs on a laptop and on many nodes.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ddptrain.config import DistConfig
from ddptrain.errors import LaunchError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job, and where it computes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    hostname: str = field(default_factory=socket.gethostname)
    # Training collectives run on this group with dist.timeout_s; the default group keeps the
    # longer start-up timeout. None when running as a single plain process.
    group: dist.ProcessGroup | None = None

    @property
    def is_distributed(self) -> bool:
        """True when a process group exists (launched by torchrun)."""
        return self.group is not None

    @property
    def is_main(self) -> bool:
        """Rank 0 prints and writes the shared files."""
        return self.rank == 0


def _int_env(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r} is not an integer") from None


def read_torchrun_env() -> tuple[int, int, int, int] | None:
    """(rank, world, local_rank, local_world) from the torchrun variables, or None when absent."""
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present:
        return None
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise LaunchError(
            f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} missing; "
            "launch with torchrun or `ddptrain launch`, or unset them to run as one process"
        )
    rank, world, local_rank = _int_env("RANK"), _int_env("WORLD_SIZE"), _int_env("LOCAL_RANK")
    local_world = _int_env("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else world
    if world < 1:
        raise LaunchError(f"WORLD_SIZE={world} must be at least 1")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is out of range for WORLD_SIZE={world} (need 0 <= RANK < WORLD_SIZE)")
    if not 0 <= local_rank < max(local_world, 1):
        raise LaunchError(f"LOCAL_RANK={local_rank} is out of range for LOCAL_WORLD_SIZE={local_world}")
    return rank, world, local_rank, local_world


def resolve_backend(requested: str) -> str:
    """auto -> nccl with CUDA, gloo without; nccl without CUDA is a user error."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise LaunchError("dist.backend=nccl needs CUDA GPUs, none are visible; use dist.backend=gloo or auto")
    return requested


def init_distributed(cfg: DistConfig) -> DistContext:
    """Create the process group from the torchrun environment and bind this rank to its device."""
    env = read_torchrun_env()
    if env is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistContext(device=device)
    rank, world, local_rank, local_world = env
    backend = resolve_backend(cfg.backend)
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise LaunchError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible on "
                f"{socket.gethostname()}; lower --nproc-per-node"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    init_kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend=backend, timeout=timedelta(seconds=cfg.startup_timeout_s), **init_kwargs
    )
    group = dist.new_group(timeout=timedelta(seconds=cfg.timeout_s), backend=backend)
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        device=device,
        backend=backend,
        group=group,
    )


def close_distributed(ctx: DistContext) -> None:
    """Destroy the process group (all groups) if one was created."""
    if ctx.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(ctx: DistContext, value: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over all ranks (returned as a new tensor; identity for one process)."""
    out = value.detach().clone()
    if ctx.is_distributed:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=ctx.group)
        out /= ctx.world_size
    return out


def all_gather_floats(ctx: DistContext, value: float) -> list[float]:
    """Every rank's value of one float, in rank order."""
    if not ctx.is_distributed:
        return [value]
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    out = [torch.zeros_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(out, t, group=ctx.group)
    return [float(x.item()) for x in out]


def any_rank(ctx: DistContext, flag: bool) -> bool:
    """True on every rank when the flag is set on at least one rank."""
    if not ctx.is_distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return bool(t.item() > 0)


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op for one process)."""
    if ctx.is_distributed:
        dist.barrier(group=ctx.group)
