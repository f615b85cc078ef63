"""Throughput and efficiency: step-phase timing, FLOPs, MFU against a peak table, peak memory.

MFU (model FLOPs utilization, PaLM paper appendix B) = achieved model FLOP/s per device divided
by the device's peak dense FLOP/s for the dtype the matmuls run in. Model FLOPs count what the
model needs (forward + backward = 3 x forward, no recomputation), so MFU is comparable between
implementations. Devices not in the table (CPUs, unknown GPUs) report achieved FLOP/s and no MFU
unless `log.peak_tflops` names the peak.
"""

from __future__ import annotations

import os
import re
import resource
import time
from collections import deque
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

# Peak dense (no structured sparsity) tensor-core TFLOP/s per device, from the vendors' data
# sheets. fp32 is the non-tensor-core rate; tf32 applies to fp32 matmuls when TF32 is allowed.
# First match wins, so the more specific names come first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H100.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"H100 NVL|H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100|H200|GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"A10G", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    (r"A10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"V100.*PCIe", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    (r"MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]


def matmul_dtype(precision: str, device: torch.device) -> str:
    """The dtype the matmuls run in: bf16/fp16 under autocast; fp32 runs as tf32 where allowed."""
    if precision in ("bf16", "fp16"):
        return precision
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of a named device for a dtype; None when the device or dtype is not known."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            tflops = peaks.get(dtype)
            return tflops * 1e12 if tflops is not None else None
    return None


def device_name(device: torch.device) -> str:
    """The device's marketing name (e.g. 'NVIDIA H100 80GB HBM3'), or 'cpu'."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def mfu(flops_per_token: float, tokens_per_s: float, world_size: int, peak_per_device: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s per device over the device's peak."""
    return flops_per_token * tokens_per_s / world_size / peak_per_device


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """(peak MiB, what was measured): CUDA max allocated by tensors, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "max_rss"  # Linux reports KiB


_KEPT_STEPS = 4096


class RunQueueWait:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat; 0 elsewhere).

    The file is opened once, by the thread to be measured (the training loop's: on CPU, autograd runs
    backward on it too); each read is one pread of a few bytes (~1 us).
    """

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


@dataclass
class _Step:
    data_s: float = 0.0
    data_cpu_wait_s: float = 0.0
    forward: list[tuple[Any, Any]] = field(default_factory=list)
    backward: list[tuple[Any, Any]] = field(default_factory=list)
    optimizer: tuple[Any, Any] | None = None
    bucket_ready: Any = None  # stamp of the last gradient bucket handed to the all-reduce


class StepTimer:
    """Times the phases of each step, adding no device synchronization of its own.

    The trainer calls start() and then lap(phase) at each phase boundary. Data wait is host time
    (the loop waiting for the next batch). Compute phases are host time on CPU, and CUDA events on
    a GPU, read only when the log window is summarized (the log step synchronizes anyway). On CPU
    each stamp also reads the thread's run-queue wait, so `local_cpu_wait_s` says how much of the
    local time was spent waiting for a CPU rather than computing (an oversubscribed host).

    With DDP, `attach()` adds a comm hook that stamps each gradient bucket as backward hands it to
    the all-reduce: the last stamp is where this rank's backward compute ended, even when the
    all-reduce overlaps it, so the rest of that backward is time spent waiting for communication.
    """

    def __init__(self, device: torch.device, distributed: bool) -> None:
        self.cuda = device.type == "cuda"
        self.distributed = distributed
        self._steps: list[_Step] = []
        self._rows: list[dict[str, float]] = []
        # Per-step values for the straggler check, bounded when no check ever takes them.
        self._local: deque[float] = deque(maxlen=_KEPT_STEPS)
        self._comm: deque[float] = deque(maxlen=_KEPT_STEPS)
        self._host = 0.0
        self._host_wait = 0.0
        self._mark: Any = None
        self._wait: RunQueueWait | None = None  # opened by the first start(), on the training thread
        self._local_wait: deque[float] = deque(maxlen=_KEPT_STEPS)
        self._ddp: DDP | None = None  # the module whose comm hook is ours (DDP takes one hook per module)
        self._send: Any = None  # a comm hook the buckets go through after the stamp (None: DDP's all-reduce)

    def _stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter(), self._waited()

    def _waited(self) -> float:
        return self._wait() if self._wait is not None else 0.0

    def attach(self, ddp: nn.Module) -> None:
        """Register the bucket-stamping comm hook on a DDP module (before its first forward).

        A sharded (FSDP2) module takes no comm hook: nothing is attached, and comm_wait_s is left out.
        """
        inner = getattr(ddp, "_orig_mod", ddp)  # torch.compile's wrapper
        if not isinstance(inner, DDP):
            # FSDP2 has no comm hooks: its reduce-scatter cannot be stamped, so comm_wait_s is left
            # out (exposed_comm_s, from the micro-batches' backward times, still applies).
            return
        group = inner.process_group

        # No annotations: DDP inspects them, and this module's postponed (string) annotations fail its check.
        def stamp_then_allreduce(state, bucket):  # type: ignore[no-untyped-def]
            if self._steps:
                self._steps[-1].bucket_ready = self._stamp()
            if self._send is not None:
                return self._send(state, bucket)
            return default_hooks.allreduce_hook(group, bucket)  # what DDP does without a hook

        inner.register_comm_hook(None, stamp_then_allreduce)
        self._ddp = inner

    def send_through(self, ddp: nn.Module, hook: Any) -> None:
        """Send ddp's gradient buckets through another comm hook (hook(state, bucket) -> Future), after the stamp.

        DDP accepts one comm hook per module and attach() already holds it, so a second hook (the overlap
        benchmark's simulated link) is chained here instead of registered.
        """
        inner = getattr(ddp, "_orig_mod", ddp)
        if inner is self._ddp:
            self._send = hook
        elif isinstance(inner, DDP):
            inner.register_comm_hook(None, hook)
        else:
            raise TypeError(f"send_through needs a DistributedDataParallel module, got {type(inner).__name__}")

    def start(self) -> None:
        """A new step begins."""
        if self._wait is None and not self.cuda:
            self._wait = RunQueueWait()
        self._steps.append(_Step())
        self._host, self._host_wait = time.perf_counter(), self._waited()
        self._mark = self._stamp()

    def lap(self, phase: str) -> None:
        """The phase ('data', 'forward', 'backward', 'optimizer') that just ended."""
        step = self._steps[-1]
        if phase == "data":
            step.data_s += time.perf_counter() - self._host
            step.data_cpu_wait_s += self._waited() - self._host_wait
            self._mark = self._stamp()
            return
        begin, self._mark = self._mark, self._stamp()
        if phase == "optimizer":
            step.optimizer = (begin, self._mark)
        else:
            getattr(step, phase).append((begin, self._mark))
        self._host, self._host_wait = time.perf_counter(), self._waited()

    def _seconds(self, span: tuple[Any, Any] | None) -> float:
        if span is None:
            return 0.0
        begin, end = span
        if self.cuda:
            end.synchronize()
            return float(begin.elapsed_time(end)) / 1000
        return float(end[0] - begin[0])

    def _cpu_wait(self, span: tuple[Any, Any] | None) -> float:
        # Host run-queue wait within a span; GPU spans time the device, which never waits for a CPU.
        if span is None or self.cuda:
            return 0.0
        return float(span[1][1] - span[0][1])

    def _resolve(self) -> None:
        # Called after a step has ended: on CUDA this waits for its last event (the log step syncs anyway).
        for s in self._steps:
            fwd = [self._seconds(x) for x in s.forward]
            bwd = [self._seconds(x) for x in s.backward]
            opt = self._seconds(s.optimizer)
            local_wait = (
                s.data_cpu_wait_s
                + sum(self._cpu_wait(x) for x in s.forward)
                + sum(self._cpu_wait(x) for x in s.backward[:-1])
                + self._cpu_wait(s.optimizer)
            )
            row = {
                "data_wait_s": s.data_s,
                "forward_s": sum(fwd),
                "backward_s": sum(bwd),
                "optimizer_s": opt,
                "local_s": s.data_s + sum(fwd) + sum(bwd[:-1]) + opt,
            }
            if s.bucket_ready is not None and s.backward:
                # The last backward: compute until its last bucket was ready, then the wait for the all-reduce.
                compute = self._seconds((s.backward[-1][0], s.bucket_ready))
                row["local_s"] += compute
                local_wait += self._cpu_wait((s.backward[-1][0], s.bucket_ready))
                row["comm_wait_s"] = max(0.0, bwd[-1] - compute)
            if self.distributed and len(bwd) >= 2:
                row["exposed_comm_s"] = max(0.0, bwd[-1] - fmean(bwd[:-1]))
            if not self.cuda:
                row["local_cpu_wait_s"] = local_wait
            self._rows.append(row)
            self._local.append(row["local_s"])
            self._comm.append(row.get("comm_wait_s", 0.0))
            self._local_wait.append(local_wait)
        self._steps = []

    def summary(self) -> dict[str, float]:
        """Mean seconds per step of each phase since the last summary (then reset).

        exposed_comm_s: the last micro-batch's backward carries DDP's gradient all-reduce, the
        others do not (no_sync), so its excess over their mean is the communication that did not
        overlap with compute. Only measurable with gradient accumulation >= 2, absent otherwise.
        local_s: data + forward + optimizer + backward compute (the backward of the last micro-batch
        up to its last gradient bucket when the comm hook is attached): the time a rank spends
        where it never waits for another rank (the straggler signal). comm_wait_s: the rest of the
        last backward, waiting for the gradient all-reduce (and for slower ranks to reach it).
        """
        self._resolve()
        rows, self._rows = self._rows, []
        if not rows:
            return {}
        return {k: fmean(r[k] for r in rows) for k in rows[-1] if all(k in r for r in rows)}

    def take_steps(self) -> tuple[list[float], list[float], list[float]]:
        """(local_s, comm_wait_s, local_cpu_wait_s) of every step since the last call (then reset), for the straggler check."""
        self._resolve()
        taken = list(self._local), list(self._comm), list(self._local_wait)
        for q in (self._local, self._comm, self._local_wait):
            q.clear()
        return taken


class Throughput:
    """Turns a log window (steps and their wall time) into throughput, efficiency and memory fields."""

    def __init__(
        self,
        device: torch.device,
        precision: str,
        world_size: int,
        global_batch: int,
        tokens_per_sample: int | None,
        flops_per_token: float | None,
        peak_tflops: float | None,
    ) -> None:
        self.device, self.world_size, self.global_batch = device, world_size, global_batch
        self.tokens_per_sample, self.flops_per_token = tokens_per_sample, flops_per_token
        self.device_name = device_name(device)
        self.dtype = matmul_dtype(precision, device)
        self.peak = peak_tflops * 1e12 if peak_tflops else peak_flops(self.device_name, self.dtype)
        if device.type == "cpu" and not peak_tflops:
            self.peak = None  # a CPU's peak depends on cores, clocks and vector units: no honest table entry

    def record(self, steps: int, seconds: float) -> dict[str, float]:
        """samples/s, tokens/s (global and per rank), FLOPs/token, achieved FLOP/s per device, MFU, memory."""
        samples_per_s = self.global_batch * steps / max(seconds, 1e-9)
        out: dict[str, Any] = {"samples_per_s": samples_per_s}
        if self.tokens_per_sample:
            tokens_per_s = samples_per_s * self.tokens_per_sample
            out["tokens_per_s"] = tokens_per_s
            out["tokens_per_s_per_rank"] = tokens_per_s / self.world_size
            if self.flops_per_token:
                out["flops_per_token"] = self.flops_per_token
                out["flops_per_s_per_device"] = self.flops_per_token * tokens_per_s / self.world_size
                if self.peak:
                    out["mfu"] = mfu(self.flops_per_token, tokens_per_s, self.world_size, self.peak)
        out["peak_mem_mb"], out["peak_mem_kind"] = peak_memory_mb(self.device)
        return out

    def step_logged(self, record: dict[str, Any], steps: int, seconds: float) -> None:
        """The loop's observer (train/hooks.py): a logged step's record gains the window's throughput fields."""
        record.update(self.record(steps, seconds))

    def describe(self) -> str:
        """One line naming the device, dtype and the peak MFU is measured against."""
        if self.peak:
            return f"MFU against {self.peak / 1e12:.1f} TFLOP/s ({self.device_name}, {self.dtype})"
        return f"no MFU: peak FLOP/s of {self.device_name} ({self.dtype}) unknown; set log.peak_tflops to report it"
