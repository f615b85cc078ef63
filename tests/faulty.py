"""A tiny regression model that misbehaves on request, for the fault tests (via model.target).

kwargs: step_sleep slows every training forward (sleeping, not computing, so slow runs cost no
CPU); fail_at / fail_rank raise at that training forward of that rank while
TORCHELASTIC_RESTART_COUNT < fail_restarts; nan_at / nan_rank make that forward's loss NaN;
record_dir gets one line per training forward and rank with a checksum of the parameters;
extra_params adds a parameter of that many floats (its gradient is all-reduced like any other)
to make the all-reduce bigger. Hangs: hang_at / hang_rank sleep hang_s inside that forward (a
marker file in record_dir, or beside the run, says when); sync_stat all-reduces a statistic over
the default group in every training forward (as SyncBatchNorm does) and skip_rank skips it at
forward skip_at. The environment variable FAULTY_DIE_IN=eval|save SIGKILLs the process in its first
evaluation forward, or its first state_dict() on the main thread (a checkpoint's capture; the live state an
in-place group sends a joining one is read on torchft's quorum thread), once it has trained a step
(one process of a job, unlike the kwargs). build_blocking_datasets: a dataset whose items block on opening a FIFO nobody
writes (I/O that never completes) on one rank from one item on.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset
from toy import IdDataset


class FaultyRegressor(nn.Module):
    def __init__(
        self,
        dim: int,
        step_sleep: float,
        fail_at: int | None,
        fail_rank: int,
        fail_restarts: int,
        nan_at: int | None,
        nan_rank: int,
        record_dir: str | None,
        extra_params: int,
        hang: tuple[int | None, int, float, str | None],
        skip: tuple[bool, int | None, int],
        flip: tuple[int | None, int, str | None],
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 1))
        self.extra = nn.Parameter(torch.zeros(extra_params)) if extra_params else None
        self.step_sleep, self.fail_at, self.fail_rank, self.fail_restarts = (
            step_sleep,
            fail_at,
            fail_rank,
            fail_restarts,
        )
        self.nan_at, self.nan_rank = nan_at, nan_rank
        self.hang_at, self.hang_rank, self.hang_s, self.hang_marker = hang
        self.sync_stat, self.skip_at, self.skip_rank = skip
        self.flip = flip
        self.rank = int(os.environ.get("RANK", "0"))
        self.die_in = os.environ.get("FAULTY_DIE_IN")
        self.forwards = 0
        self.record = None
        if record_dir:
            Path(record_dir).mkdir(parents=True, exist_ok=True)
            self.record = Path(record_dir) / f"params-rank{self.rank}-pid{os.getpid()}.txt"

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.die_in == "save" and self.forwards and threading.current_thread() is threading.main_thread():
            os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict(*args, **kwargs)

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.training and flip_due(*self.flip, self.forwards + 1):  # before autograd saves the weight
            flip_bit(self.net[0].weight)
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.extra is not None:
            loss = loss + 0.0 * self.extra.sum()
        if not self.training:
            if self.die_in == "eval" and self.forwards:
                os.kill(os.getpid(), signal.SIGKILL)
            return loss
        self.forwards += 1
        if self.record is not None:
            checksum = sum(float(p.detach().double().sum()) for p in self.parameters())
            with open(self.record, "a") as f:
                f.write(f"{self.forwards} {checksum!r}\n")
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.fail_at == self.forwards and self.rank == self.fail_rank and restarts < self.fail_restarts:
            raise RuntimeError(f"injected failure at forward {self.forwards} on rank {self.rank}")
        if self.nan_at == self.forwards and self.rank == self.nan_rank:
            loss = loss * float("nan")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        first_try = restarts == 0
        if self.sync_stat and not (first_try and self.forwards == self.skip_at and self.rank == self.skip_rank):
            stat = x.detach().mean().reshape(1)
            dist.all_reduce(stat)  # the default group, like SyncBatchNorm's statistics
        if first_try and self.hang_at == self.forwards and self.rank == self.hang_rank:
            if self.hang_marker:
                Path(self.hang_marker).write_text(repr(time.time()))
            time.sleep(self.hang_s)
        return loss


def build_model(
    dim: int = 8,
    step_sleep: float = 0.0,
    fail_at: int | None = None,
    fail_rank: int = 0,
    fail_restarts: int = 1,
    nan_at: int | None = None,
    nan_rank: int = 0,
    record_dir: str | None = None,
    extra_params: int = 0,
    hang_at: int | None = None,
    hang_rank: int = 1,
    hang_s: float = 0.0,
    hang_marker: str | None = None,
    sync_stat: bool = False,
    skip_at: int | None = None,
    skip_rank: int = 1,
    flip_at: int | None = None,
    flip_rank: int = 1,
    flip_marker: str | None = None,
) -> nn.Module:
    return FaultyRegressor(
        dim,
        step_sleep,
        fail_at,
        fail_rank,
        fail_restarts,
        nan_at,
        nan_rank,
        record_dir,
        extra_params,
        (hang_at, hang_rank, hang_s, hang_marker),
        (sync_stat, skip_at, skip_rank),
        (flip_at, flip_rank, flip_marker),
    )


def flip_due(at: int | None, rank: int, marker: str | None, count: int) -> bool:
    """Whether this rank flips a bit now: at the count-th call, on `rank`, once (the marker file says it did)."""
    if at != count or int(os.environ.get("RANK", "0")) != rank or (marker and os.path.exists(marker)):
        return False
    if marker:
        Path(marker).write_text(f"flipped at {count} on rank {rank}\n")
    return True


def flip_bit(t: torch.Tensor) -> None:
    """Flip bit 3 of the first element's bytes in place: a tiny change no loss would show."""
    local = t.to_local() if isinstance(t, DTensor) else t  # FSDP/HSDP: this rank's shard
    with torch.no_grad():
        local.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 3)


class FlippingAdamW(torch.optim.AdamW):
    """AdamW whose flip_at-th step is followed by a bit flip in the first parameter's exp_avg on flip_rank."""

    def __init__(self, params: Any, flip: tuple[int | None, int, str | None], **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.flip, self.steps = flip, 0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().step(*args, **kwargs)
        self.steps += 1
        if flip_due(*self.flip, self.steps):
            first = self.param_groups[0]["params"][0]
            flip_bit(self.state[first]["exp_avg"])
        return out


def build_flipping_adamw(
    param_groups: Any, flip_at: int | None = None, flip_rank: int = 1, flip_marker: str | None = None
) -> torch.optim.Optimizer:
    return FlippingAdamW(param_groups, (flip_at, flip_rank, flip_marker), fused=True)


class BlockingDataset(Dataset):
    """IdDataset whose items block forever (opening a FIFO for reading, no writer) once block_after were read on block_rank."""

    def __init__(self, inner: Dataset, block_rank: int, block_after: int, fifo: str) -> None:
        self.inner, self.fifo, self.reads = inner, fifo, 0
        self.armed = (
            int(os.environ.get("RANK", "0")) == block_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        )
        self.block_after = block_after

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.reads += 1
        if self.armed and self.reads > self.block_after:
            with open(self.fifo, "rb") as f:  # blocks in open(): nobody ever opens the FIFO for writing
                f.read()
        return self.inner[i]


def build_blocking_datasets(
    fifo: str, block_rank: int = 1, block_after: int = 100, n: int = 4096, dim: int = 8
) -> tuple[Dataset, Dataset]:
    if not os.path.exists(fifo):
        try:
            os.mkfifo(fifo)
        except FileExistsError:
            pass  # another rank made it first
    return BlockingDataset(IdDataset(n, dim, seed=0), block_rank, block_after, fifo), IdDataset(64, dim, seed=1)
