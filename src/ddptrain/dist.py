"""The distributed context, read from the torchrun environment.

torchrun (TorchElastic) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT for every worker. With none of them set we run as one plain process and create no
process group at all, so the same code runs on a laptop and on many nodes.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in torch's __all__

from ddptrain.config import DistConfig
from ddptrain.errors import DdptrainError, LaunchError
from ddptrain.ft_env import BIND_ENV

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
    # False when the caller initialised torch.distributed itself (the Python API under a user's
    # own launcher): then closing the run leaves the default group alone.
    owns_default_group: bool = True
    # Every rank's hostname in rank order, gathered once when the context is created.
    hosts: tuple[str, ...] = ()

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
    port = _int_env("MASTER_PORT")
    if not 0 < port < 65536:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
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
    """Create the process group from the torchrun environment and bind this rank to its device.

    Collectives: the process group's rendezvous, one new group, one all-gather of host names.
    """
    env = read_torchrun_env()
    if env is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ctx = DistContext(device=device)
        return replace(ctx, hosts=(ctx.hostname,))
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
    owns = not dist.is_initialized()
    if owns:
        _create_default_group(backend, device, rank, world, timedelta(seconds=cfg.startup_timeout_s))
    group = dist.new_group(timeout=timedelta(seconds=cfg.timeout_s), backend=backend)
    ctx = DistContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        device=device,
        backend=backend,
        group=group,
        owns_default_group=owns,
    )
    return replace(ctx, hosts=tuple(gather_hostnames(ctx)))


# Set by `ddptrain launch`: the one address rank 0 binds its store to (loopback on one node, the
# node's --node-addr otherwise). torch's TCPStore server listens on every interface by itself.
BIND_ADDR_ENV = BIND_ENV


def listening_store(addr: str, port: int, timeout: timedelta, world_size: int | None = None) -> TCPStore:
    """A TCPStore server listening on addr only (port 0: a free one), not on every interface."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(1024)
        bound_port = sock.getsockname()[1]
        # The store takes the socket over (libuv backend) and closes it with the store.
        return TCPStore(
            addr,
            bound_port,
            world_size,
            True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise


def _create_default_group(backend: str, device: torch.device, rank: int, world: int, timeout: timedelta) -> None:
    """init_process_group through the job's store; a store that cannot be reached or joined is one line.

    A rank that connects to the store (all but the one serving it) first waits for it to accept
    connections, polling: torch's client would log some 80 lines of C++ frames per failed attempt,
    and then raise an error that names neither the rank nor what MASTER_ADDR:MASTER_PORT came from.
    Whatever else torch raises about the store (a port in use, ranks that never join) is caught
    and said in one line too, with the same rank, host:port and torch's own first line.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    serves = rank == 0 and (BIND_ADDR_ENV in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")
    if not serves:
        why = probe_store(host, port, time.monotonic() + timeout.total_seconds(), poll_s=0.05, wait_for_dns=True)
        if why is not None:
            raise _store_failure(
                f"rank {rank} cannot reach the job's store at {host}:{port} (MASTER_ADDR:MASTER_PORT) within "
                f"{timeout.total_seconds():g} s ({why}); is rank 0 (or the launcher on that host) running, and is "
                "the port open from here?"
            )
    init_kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    try:
        store = _worker_store(rank, world, timeout)
        if store is not None:
            init_kwargs.update(store=store, rank=rank, world_size=world)
        dist.init_process_group(backend=backend, timeout=timeout, **init_kwargs)
    except dist.DistError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        role = f"serving the job's store on port {port}" if serves else f"joining through the store at {host}:{port}"
        raise _store_failure(f"rank {rank} of {world} failed {role} (MASTER_ADDR:MASTER_PORT): {first}") from None


def _store_failure(text: str) -> DdptrainError:
    """Exit 2 for a hand-set environment (bad input: the same one fails again); exit 1 under torchrun's
    agent (TORCHELASTIC_RUN_ID), which set the variables itself and may restart the workers to recover."""
    return DdptrainError(text) if "TORCHELASTIC_RUN_ID" in os.environ else LaunchError(text)


def _worker_store(rank: int, world: int, timeout: timedelta) -> TCPStore | None:
    """With BIND_ADDR_ENV set: rank 0 serves the job's store on that address only, the others connect
    (once probe_store saw it listen)."""
    bind = os.environ.get(BIND_ADDR_ENV)
    if not bind:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        try:
            return listening_store(bind, port, timeout, world)
        except OSError as e:
            raise LaunchError(f"cannot serve the job's store on {bind}:{port}: {e.strerror or e}") from None
    return TCPStore(host, port, world, False, timeout=timeout)


def probe_store(
    host: str, port: int, deadline: float, *, poll_s: float = 0.25, wait_for_dns: bool = False
) -> str | None:
    """Connect to a store until the deadline; None when it answers, else why not (one line).

    After a restart the other ranks often start before rank 0's store listens; TCPStore's own
    retry backs off for seconds between attempts (the recovery timeline showed ~6 s in "process
    group"), while polling every 50 ms (poll_s) connects within 50 ms of the store being up. A name
    that does not resolve is final unless wait_for_dns (a Service's name may appear late).
    """
    why = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return None
        except socket.gaierror as e:
            why = f"{host} does not resolve ({e.strerror})"
            if not wait_for_dns:
                return why
        except ConnectionRefusedError:
            why = "connection refused: nothing listens there"
        except TimeoutError:
            why = "connection attempts time out: a firewall, a wrong address or no route"
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else str(e)
            if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                why = f"{why}: no route to that address"
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def close_distributed(ctx: DistContext) -> None:
    """Destroy the process groups this run created (all of them when it created the default one)."""
    if not (ctx.is_distributed and dist.is_initialized()):
        return
    if ctx.owns_default_group:
        dist.destroy_process_group()
    elif ctx.group is not None:
        dist.destroy_process_group(ctx.group)


def all_reduce_mean(ctx: DistContext, value: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over all ranks (returned as a new tensor; identity for one process)."""
    out = value.detach().clone()
    if ctx.is_distributed:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=ctx.group)
        out /= ctx.world_size
    return out


def max_over_ranks(ctx: DistContext, value: int) -> int:
    """The largest of every rank's small integer (an exit code, a flag), on every rank: one all-reduce."""
    if not ctx.is_distributed:
        return value
    t = torch.tensor([float(value)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return int(t.item())


def gather_hostnames(ctx: DistContext) -> list[str]:
    """Every rank's hostname in rank order (one collective, called once by the run's set-up)."""
    return [str(h) for h in all_gather_object(ctx, ctx.hostname)]


def all_gather_object(ctx: DistContext, value: Any) -> list[Any]:
    """Every rank's picklable value, in rank order ([value] for one process)."""
    if not ctx.is_distributed:
        return [value]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value, group=ctx.group)
    return out


def broadcast_object(ctx: DistContext, value: Any, src: int = 0) -> Any:
    """Rank src's value on every rank (identity for one process)."""
    if not ctx.is_distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=ctx.group)
    return box[0]


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op for one process)."""
    if ctx.is_distributed:
        dist.barrier(group=ctx.group)
