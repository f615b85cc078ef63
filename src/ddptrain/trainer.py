"""The Trainer: one object, plainly named steps. Read `train_step` to see a whole DDP step.

    fit()            loop: train_step -> log -> evaluate -> checkpoint, until max_steps
    train_step()     accumulate micro-batches (all-reduce only on the last), clip, step
    evaluate()       mean validation loss over all ranks
    save_checkpoint  transactional save through the Checkpointer
    state_dict()     everything a bit-exact resume needs (RNGs are saved per rank)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from ddptrain.checkpoint import Checkpointer, SaveResult, load_file
from ddptrain.config import Config
from ddptrain.data.sampler import ResumableDistributedSampler
from ddptrain.dist import DistContext, all_reduce_mean
from ddptrain.errors import CheckpointError
from ddptrain.metrics import MetricsWriter, Progress
from ddptrain.perf import StepTimer, Throughput
from ddptrain.precision import Precision
from ddptrain.preemption import Preempted, StopRequest
from ddptrain.rng import load_rng_state, rng_state, seed_everything
from ddptrain.triage import Triage
from ddptrain.stragglers import StragglerMonitor


class NonFiniteError(RuntimeError):
    """Raised on every rank at once when train.on_nonfinite=stop and the gradient is NaN/inf."""


class CheckpointSaveError(RuntimeError):
    """Raised on every rank at once when a save failed and ckpt.on_error=stop."""


@dataclass
class StepResult:
    """What one optimizer step produced (loss is this rank's mean over its micro-batches)."""

    loss: torch.Tensor
    grad_norm: float
    skipped: bool
    seconds: float


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _call(model: nn.Module, batch: Any) -> torch.Tensor:
    # The user-model protocol: a tuple batch is unpacked positionally, a dict by keyword.
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (not biases/norms), fused where the device supports it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=cfg.train.betas, fused=fused)


def lr_factor(step: int, cfg: Config) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at max_steps."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Trains one model with DDP on the ranks of `ctx`."""

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        model: nn.Module,
        train_set: Dataset,
        val_set: Dataset | None,
        checkpointer: Checkpointer,
        metrics: MetricsWriter,
        progress: Progress,
    ) -> None:
        self.cfg, self.ctx, self.checkpointer = cfg, ctx, checkpointer
        self.metrics, self.progress = metrics, progress
        self.model = model.to(ctx.device)
        self.accum = cfg.grad_accum_steps(ctx.world_size)
        self.ddp: nn.Module = self.model
        if ctx.is_distributed:
            d = cfg.dist
            # DDP all-reduces each gradient bucket as soon as backward has filled it, so the
            # communication of late layers overlaps the backward of early ones.
            self.ddp = DDP(
                self.model,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                process_group=ctx.group,
                bucket_cap_mb=d.bucket_cap_mb,
                static_graph=d.static_graph,
                gradient_as_bucket_view=d.gradient_as_bucket_view,
                find_unused_parameters=d.find_unused_parameters,
            )
        if cfg.train.compile:
            self.ddp = torch.compile(self.ddp)  # compiling the DDP wrapper keeps bucketed overlap
        self.optimizer = build_optimizer(self.model, cfg, ctx.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.precision = Precision(cfg.train.precision, ctx.device)
        self.sampler = ResumableDistributedSampler(
            len(train_set), cfg.train.global_batch_size, ctx.rank, ctx.world_size, cfg.run.seed  # type: ignore[arg-type]
        )
        pin = ctx.device.type == "cuda"
        # The loader gets its own generator: creating an iterator (at resume, at each epoch)
        # must not draw from the global torch RNG, or a resumed run's dropout would diverge.
        self.loader = DataLoader(
            train_set, batch_size=cfg.data.micro_batch_size, sampler=self.sampler,
            num_workers=cfg.data.num_workers, pin_memory=pin,
            generator=torch.Generator().manual_seed(cfg.run.seed + ctx.rank),
        )
        self.val_set = val_set
        self.tokens_per_sample: int | None = getattr(train_set, "tokens_per_sample", None)
        flops = getattr(self.model, "flops_per_token", None)
        self.flops_per_token: float | None = flops() if callable(flops) else None
        self.timer = StepTimer(ctx.device, ctx.is_distributed)
        self.throughput = Throughput(ctx.device, cfg.train.precision, ctx.world_size, cfg.train.global_batch_size,
                                     self.tokens_per_sample, self.flops_per_token, cfg.log.peak_tflops)
        self.stragglers = StragglerMonitor(ctx, cfg.log.straggler_every, cfg.log.straggler_factor)
        self.step = 0
        self._batches: Iterator[Any] | None = None

    # ---- the training step ----------------------------------------------------------------

    def next_batch(self) -> Any:
        """The next micro-batch of this rank; a new epoch (reshuffled) starts when one is used up."""
        if self.sampler.epoch_done:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._batches = None
        if self._batches is None:
            self._batches = iter(self.loader)
        return _to_device(next(self._batches), self.ctx.device)

    def train_step(self) -> StepResult:
        """One optimizer step over `accum` micro-batches of this rank."""
        t0 = time.perf_counter()
        self.timer.start()
        self.ddp.train()
        loss_sum = torch.zeros((), device=self.ctx.device)
        for micro in range(self.accum):
            batch = self.next_batch()
            self.timer.lap("data")
            # Gradients of the first accum-1 micro-batches accumulate locally: no_sync() skips
            # their all-reduce, and the last backward all-reduces the sum once.
            last = micro == self.accum - 1
            sync = nullcontext() if last or not isinstance(self.ddp, DDP) else self.ddp.no_sync()
            with sync, self.precision.autocast():
                loss = _call(self.ddp, batch) / self.accum
            self.timer.lap("forward")
            self.precision.backward(loss)
            self.timer.lap("backward")
            loss_sum += loss.detach()
        self.sampler.advance()
        self.precision.unscale_(self.optimizer)
        # After DDP's all-reduce every rank holds the same gradients, so every rank computes the
        # same norm: the finite check below is agreed on by all ranks without a collective.
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        skipped = not math.isfinite(norm) and self.cfg.train.precision != "fp16"
        if skipped and self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(f"non-finite gradient norm ({norm}) at step {self.step + 1}")
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.precision.step(self.optimizer)  # with fp16 the scaler itself skips overflowing steps
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.timer.lap("optimizer")
        self.step += 1
        return StepResult(loss_sum, norm, skipped, time.perf_counter() - t0)

    # ---- evaluation -------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first eval_batches micro-batches of every rank."""
        if self.val_set is None:
            return None
        self.model.eval()
        mb, world = self.cfg.data.micro_batch_size, self.ctx.world_size
        n = min(len(self.val_set), self.cfg.train.eval_batches * mb * world)  # type: ignore[arg-type]
        ids = list(range(self.ctx.rank, n, world))
        total = torch.zeros((), device=self.ctx.device)
        batches = 0
        for i in range(0, len(ids), mb):
            batch = torch.utils.data.default_collate([self.val_set[j] for j in ids[i : i + mb]])
            with self.precision.autocast():
                total += _call(self.model, _to_device(batch, self.ctx.device)).float()
            batches += 1
        local = total / max(batches, 1)
        return float(all_reduce_mean(self.ctx, local))

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Rank-independent training state (model, optimizer, schedule, scaler, data position)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "trainer": {
                "step": self.step,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.state_dict(),
                "sampler": self.sampler.state_dict(),
                "world_size": self.ctx.world_size,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict(); the data stream continues at the next global sample."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        t = state["trainer"]
        self.step = t["step"]
        self.scheduler.load_state_dict(t["scheduler"])
        self.precision.load_state_dict(t["scaler"])
        self.sampler.load_state_dict(t["sampler"])
        self._batches = None

    def save_checkpoint(self) -> None:
        """All ranks: save the current step (model/optimizer on rank 0, RNG on every rank)."""
        state = self.state_dict() if self.ctx.is_main else {}
        self.checkpointer.save(self.step, state, {"rng": rng_state()})

    def resume(self, path: Path, manifest: dict[str, Any]) -> None:
        """Load a verified checkpoint; RNGs come back per rank when the world size is unchanged."""
        try:
            state = {name: load_file(path, f"{name}.pt") for name in ("model", "optimizer", "trainer")}
        except (RuntimeError, OSError, KeyError) as e:
            raise CheckpointError(f"cannot load {path}: {e}") from None
        self.load_state_dict(state)
        rng_file = path / f"rng-rank{self.ctx.rank}.pt"
        if manifest["world_size"] == self.ctx.world_size and rng_file.is_file():
            load_rng_state(load_file(path, rng_file.name))
        else:
            # A new world size has no saved stream for this rank: derive one deterministically.
            seed_everything(self.cfg.run.seed + 7919 * self.step + self.ctx.rank)

    # ---- the loop ---------------------------------------------------------------------------

    def fit(self, stop_request: StopRequest | None = None, watchdog: Triage | None = None) -> None:
        """Train until train.max_steps, logging, evaluating and checkpointing on the way.

        stop_request: a coordinated stop (all ranks agree each step; Preempted after the checkpoint).
        watchdog: armed around each step to dump stacks when a step hangs.
        """
        cfg = self.cfg
        window_loss = torch.zeros((), device=self.ctx.device)
        window_steps, window_time, window_skipped = 0, 0.0, 0
        while self.step < cfg.train.max_steps:
            if watchdog is not None:
                watchdog.arm()
            result = self.train_step()
            stop = stop_request is not None and stop_request.agreed(self.ctx)
            if watchdog is not None:
                watchdog.disarm()
            window_loss += result.loss
            window_steps += 1
            window_time += result.seconds
            window_skipped += result.skipped
            last = self.step == cfg.train.max_steps
            if self.step % cfg.log.every_steps == 0 or last:
                self.log_train(window_loss / window_steps, window_steps, window_time, window_skipped, result.grad_norm)
                window_loss.zero_()
                window_steps, window_time, window_skipped = 0, 0.0, 0
            if self.stragglers.due(self.step):
                self.log_stragglers()
            if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or last):
                self.log_eval()
            if last or stop or (cfg.ckpt.every_steps and self.step % cfg.ckpt.every_steps == 0):
                self.save_checkpoint()
                self.report_saves()
            if stop and not last:
                self.checkpointer.wait()
                self.report_saves()
                raise Preempted(self.step, stop_request.signal_name if stop_request else None)
        self.checkpointer.wait()
        self.report_saves()

    def log_train(self, mean_loss: torch.Tensor, steps: int, seconds: float, skipped: int, grad_norm: float) -> None:
        """All ranks: average the window's loss over ranks; rank 0 writes and shows it."""
        loss = float(all_reduce_mean(self.ctx, mean_loss))
        record: dict[str, Any] = {
            "step": self.step,
            "epoch": self.sampler.epoch,
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "world_size": self.ctx.world_size,
            "global_batch_size": self.cfg.train.global_batch_size,
            "grad_accum": self.accum,
            "step_time_s": seconds / steps,
            **self.throughput.record(steps, seconds),
            **self.timer.summary(),
        }
        if skipped:
            record["skipped_steps"] = skipped
            self.progress.message(f"warning: {skipped} step(s) skipped for a non-finite gradient before step {self.step}")
        self.metrics.write("train", **record)
        shown = {k: record[k] for k in ("loss", "lr", "samples_per_s", "tokens_per_s", "mfu") if k in record}
        self.progress.update(self.step, shown)

    def log_stragglers(self) -> None:
        """All ranks: compare local step times; rank 0 records them, every rank logs a straggler warning."""
        record, warning = self.stragglers.check(self.step, self.timer.take_local())
        self.metrics.write("ranks", **record)
        if warning:
            self.progress.message(warning)

    def log_eval(self) -> None:
        """All ranks evaluate; rank 0 records val_loss."""
        val_loss = self.evaluate()
        if val_loss is None:
            return
        self.metrics.write("eval", step=self.step, val_loss=val_loss)
        self.progress.message(f"step {self.step:>6}  val_loss {val_loss:.4f}")

    def report_saves(self) -> None:
        """Record finished saves; a failed one stops the run (on all ranks) unless on_error=continue."""
        for r in self.checkpointer.finished():
            self._report_save(r)

    def _report_save(self, r: SaveResult) -> None:
        if r.ok:
            self.metrics.write("event", event="checkpoint", step=r.step, blocked_s=r.blocked_s, total_s=r.total_s,
                               path=str(r.path))
            self.progress.message(f"checkpoint step {r.step} committed ({r.total_s:.2f}s, loop blocked {r.blocked_s:.3f}s)")
            return
        self.metrics.write("event", event="checkpoint_failed", step=r.step, error=r.error)
        self.progress.message(f"error: checkpoint at step {r.step} was not committed: {r.error}; earlier checkpoints are kept")
        if self.cfg.ckpt.on_error == "stop":
            raise CheckpointSaveError(f"checkpoint at step {r.step} failed: {r.error}")
