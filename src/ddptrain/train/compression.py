"""Compressed gradients: DDP's all-reduce through torch's communication hooks (dist.grad_compression).

fp16 and bf16 cast each gradient bucket to half precision (divided by the world size first), all-reduce it and
cast back (torch's `fp16_compress_hook`, `bf16_compress_hook`): half the bytes of fp32. gloo has no bfloat16
all-reduce (pytorch#111131), so bf16 is refused there before anything starts (`check_backend`): carrying
bf16-rounded values in an fp32 all-reduce would keep bf16's error and save no byte.

PowerSGD (`powerSGD_hook`) sends two rank-r factors per gradient matrix instead of the matrix, and keeps what
the approximation missed (error feedback) to add to the next step's gradient. Its state is training state:
the error feedback differs on every rank, the Q factors (warm start) and the seed stream are shared. torch keys
that state by gradient bucket, and DDP rebuilds its buckets once after the first step of every process, so a
resumed process sees other buckets than the run it continues. `PowerSgd` therefore saves the state per
parameter (by name) and lays it back into whatever buckets the process has, when each bucket first asks for
it and again when DDP has rebuilt them: a resume is bit for bit the uninterrupted run.

Every hook here is sent through the step timer's own comm hook (observe/perf.py: DDP takes one hook per
module), so the timer stamps each bucket before it is compressed.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config.kinds import GRAD_COMPRESSIONS, NO_COMPRESSION
from ddptrain.config.system import DistConfig
from ddptrain.errors import ConfigError
from ddptrain.observe.perf import StepTimer

log = logging.getLogger(__name__)

Future = torch.futures.Future[torch.Tensor]
MIN_COMPRESSION_RATE = 2.0  # torch's default: a matrix is compressed when the factors are < half its size


def check_backend(cfg: DistConfig, backend: str | None) -> None:
    """ConfigError (exit 2) for a compression the process group's backend cannot all-reduce (before any collective)."""
    if cfg.grad_compression == "bf16" and backend == "gloo":
        raise ConfigError(
            "dist.grad_compression=bf16 needs NCCL: gloo has no bfloat16 all-reduce (pytorch#111131); "
            "use dist.grad_compression=fp16 (the same bytes) or powersgd"
        )


class Compression(ABC):
    """A compressed all-reduce of DDP's gradient buckets; `hook(bucket)` returns the future of the averaged bucket."""

    def __init__(self, cfg: DistConfig, ddp: DDP) -> None:
        self.group: dist.ProcessGroup = ddp.process_group

    @abstractmethod
    def hook(self, bucket: GradBucket) -> Future:
        """The bucket averaged over the ranks, through this compression."""

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's state to checkpoint (None: the compression keeps none)."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Continue from state_dict() (None: none was saved for this rank) at optimizer step `step`: nothing kept here."""
        return None


class Fp16(Compression):
    """Buckets all-reduced as float16."""

    def hook(self, bucket: GradBucket) -> Future:
        """torch's fp16_compress_hook."""
        return default_hooks.fp16_compress_hook(self.group, bucket)


class Bf16(Compression):
    """Buckets all-reduced as bfloat16 (NCCL)."""

    def hook(self, bucket: GradBucket) -> Future:
        """torch's bf16_compress_hook."""
        return default_hooks.bf16_compress_hook(self.group, bucket)


def factor_lengths(shape: torch.Size, rank: int) -> tuple[int, int] | None:
    """(P length, Q length) of PowerSGD's rank-`rank` factors of a gradient of `shape` (viewed as n x m, n its first
    dimension), or None when powerSGD_hook sends it whole: unless the factors are under half its size."""
    n = shape[0] if len(shape) else 1
    m = shape.numel() // max(n, 1)
    r = min(n, m, rank)
    return (n * r, m * r) if (n + m) * r * MIN_COMPRESSION_RATE < n * m else None


def payload_bytes(params: Iterable[torch.Tensor], mode: str, rank: int) -> int:
    """Bytes one step's gradient all-reduce carries under dist.grad_compression=`mode` (PowerSGD from its first
    compressed step on; a ring all-reduce moves them 2 (W - 1) / W times over each rank's link)."""
    total = 0
    for p in params:
        if mode in ("fp16", "bf16"):
            total += 2 * p.numel()
            continue
        factors = factor_lengths(p.shape, rank) if mode == "powersgd" else None
        total += (sum(factors) if factors else p.numel()) * p.element_size()
    return total


def attach(cfg: DistConfig, ddp: Any, timer: StepTimer) -> Compression | None:
    """The compression dist.grad_compression names, its hook sent through the step timer's; None when there is
    none or no DDP module to compress (one process, or a sharded model)."""
    inner = getattr(ddp, "_orig_mod", ddp)  # torch.compile's wrapper
    if cfg.grad_compression == NO_COMPRESSION or not isinstance(inner, DDP):
        return None
    compression: Compression = GRAD_COMPRESSIONS.load(cfg.grad_compression)(cfg, inner)

    def send(_state, bucket):  # type: ignore[no-untyped-def]  # DDP inspects a hook's annotations: none here
        return compression.hook(bucket)

    timer.send_through(inner, send)
    params = [p for p in inner.parameters() if p.requires_grad]
    full, sent = (
        payload_bytes(params, NO_COMPRESSION, 0),
        payload_bytes(params, cfg.grad_compression, cfg.powersgd_rank),
    )
    log.info("dist.grad_compression=%s: %.4g MB per step's all-reduce instead of %.4g MB", cfg.grad_compression,
             sent / 1e6, full / 1e6)  # fmt: skip
    return compression


class PowerSgd(Compression):
    """torch's PowerSGD hook, its state saved per parameter (see the module docstring)."""

    def __init__(self, cfg: DistConfig, ddp: DDP) -> None:
        super().__init__(cfg, ddp)
        self.rank = cfg.powersgd_rank
        self.ddp = ddp
        # Step s (from 1) is the hook's iteration s - 1: compression starts at step powersgd_start_step.
        self.state = PowerSGDState(
            self.group,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_step - 1,
            min_compression_rate=MIN_COMPRESSION_RATE,
            compression_stats_logging_frequency=2**62,  # torch's own log line: never
        )
        self.names = {id(p): n for n, p in ddp.module.named_parameters()}
        self.layouts: dict[int, list[tuple[str, torch.Tensor]]] = {}  # bucket -> (name, gradient view) in order
        self.pool: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})  # per name: error, Q
        self.rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", False))
        # The hook all-reduces P and Q in callbacks of the previous all-reduce's future. gloo runs those on its
        # own threads, racing the next bucket's all-reduces from backward: the ranks could start collectives in
        # different orders (seen: a rank aborted in gloo). Each bucket is therefore finished before the next
        # starts there. NCCL runs the callbacks in order on the calling thread (its futures complete on enqueue).
        self.serial = dist.get_backend(self.group) != "nccl"

    def hook(self, bucket: GradBucket) -> Future:
        """powerSGD_hook, after laying this process's saved state into the bucket (once per bucket layout)."""
        rebuilt = bool(getattr(self.ddp, "_has_rebuilt_buckets", False))
        if rebuilt != self.rebuilt:  # DDP regrouped its parameters: every bucket's state back to per parameter
            self.rebuilt = rebuilt
            self.pool = self._per_parameter()
            for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
                memory.clear()
            self.layouts.clear()
        index = bucket.index()
        if index not in self.layouts:
            self.layouts[index] = [(self.names[id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients())]
            self._lay_out(index, bucket.buffer())
        sent = powerSGD_hook(self.state, bucket)
        if self.serial:
            sent.wait()  # gloo: see __init__
        return sent

    def _compressed(self, index: int) -> list[tuple[str, int, int]]:
        """(name, P length, Q length) of the bucket's compressed matrices in the order powerSGD_hook lays out its
        P and Q memory: grouped by shape (groups in order of first appearance), bucket order within a group."""
        by_shape: dict[tuple[int, ...], list[tuple[str, int, int]]] = defaultdict(list)
        for name, grad in self.layouts[index]:
            factors = factor_lengths(grad.shape, self.rank)
            if factors is not None:
                n = grad.shape[0] if grad.dim() else 1
                by_shape[(n, grad.numel() // max(n, 1))].append((name, *factors))
        return [entry for group in by_shape.values() for entry in group]

    def _per_parameter(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The error feedback and Q factors of every bucket, per parameter name (copies), with what the pool holds."""
        errors, qs = dict(self.pool[0]), dict(self.pool[1])
        for index in self.layouts:
            if index in self.state.error_dict:
                flat, offset = self.state.error_dict[index], 0
                for name, grad in self.layouts[index]:
                    errors[name] = flat[offset : offset + grad.numel()].clone()
                    offset += grad.numel()
            if index in self.state.q_memory_dict:
                flat, offset = self.state.q_memory_dict[index], 0
                for name, _, length in self._compressed(index):
                    qs[name] = flat[offset : offset + length].clone()
                    offset += length
        return errors, qs

    def _lay_out(self, index: int, buffer: torch.Tensor) -> None:
        """Bucket `index`'s error feedback and warm-start factors from the pool, when it holds all of them."""
        errors, qs = self.pool
        names = [name for name, _ in self.layouts[index]]
        if names and all(name in errors for name in names):
            self.state.error_dict[index] = torch.cat([errors.pop(name) for name in names]).to(buffer)
        compressed = self._compressed(index)
        if compressed and all(name in qs for name, _, _ in compressed):
            self.state.q_memory_dict[index] = torch.cat([qs.pop(name) for name, _, _ in compressed]).to(buffer)
            # P is overwritten before it is read: its presence tells the hook to warm-start from Q.
            self.state.p_memory_dict[index] = buffer.new_empty(sum(p for _, p, _ in compressed))

    def state_dict(self) -> dict[str, Any]:
        """The hook's iteration, seed stream and counters, and per parameter name the error feedback and Q factors."""
        errors, qs = self._per_parameter()
        s = self.state
        name, keys, pos, has_gauss, cached = s.rng.get_state(legacy=True)
        assert not isinstance(keys, str)
        return {
            "powersgd_rank": self.rank,
            "iter": s.iter,
            "rng": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
            "numel": (s.total_numel_before_compression, s.total_numel_after_compression),
            "error": errors,
            "q": qs,
        }

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Continue the saved state; with none (another world size, another compression before) or another rank,
        fresh error feedback and factors from this step on, said in one warning."""
        s = self.state
        if state is None or state.get("powersgd_rank") != self.rank:
            s.iter = step
            if step >= s.start_powerSGD_iter:
                why = (
                    "the checkpoint holds none for this rank (another world size, or another compression)"
                    if state is None
                    else "the checkpoint's was made with another powersgd_rank"
                )
                log.warning("PowerSGD starts with fresh error feedback and factors at step %d: %s", step, why)
            return
        name, keys, pos, has_gauss, cached = state["rng"]
        s.rng.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        s.iter = int(state["iter"])
        s.total_numel_before_compression, s.total_numel_after_compression = state["numel"]
        self.pool = (dict(state["error"]), dict(state["q"]))
        for memory in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
            memory.clear()
        self.layouts.clear()
