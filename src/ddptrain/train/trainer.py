"""The Trainer: one object, plainly named steps. Read `train_step` to see a whole DDP step.

fit()            loop: train_step -> log -> evaluate -> checkpoint, until max_steps (or an early stop, a hook's
                 stop: train/early_stop.py, train/hooks.py); the run's observers (watchdog, throughput,
                 certificate, stragglers, replica checks) hear the loop's events (`observers`, train/hooks.py)
train_step()     the one training step, whatever the sync (train/sync/): this rank's share of the global batch,
                 micro-batches accumulated (all-reduce only on the last, over the sync's ranks), the sync's
                 commit (the in-place mode's vote: a discarded attempt is tried again), clip, step, then the
                 sync's after_update (DiLoCo's outer step every H steps);
                 no device-to-host sync unless the step is logged (`logs_at`)
evaluate()       mean validation loss (and metrics of your own) over all ranks
log_eval()       records an evaluation; train.early_stop judges it (train/early_stop.py)
save_checkpoint  transactional save through the Checkpointer
state_dict()     everything a bit-exact resume needs (RNGs are saved per rank)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ddptrain.checkpoint import Checkpointer, SaveResult, VerifiedCheckpoint
from ddptrain.config import Config
from ddptrain.data.collate import build_collate
from ddptrain.data.kinds import data_source
from ddptrain.data.mixture import SOURCE_VAL_LOSS, MixtureValidation
from ddptrain.dist import DistContext
from ddptrain.errors import LeaseLost, Preempted
from ddptrain.models.loss import extract_loss, model_name, model_output, to_device
from ddptrain.observe.metrics import MetricsWriter, Progress
from ddptrain.observe.perf import StepTimer
from ddptrain.observe.recovery import RecoveryTimeline
from ddptrain.train.agreement import StopAgreement
from ddptrain.train.custom_metrics import CustomMetrics, merge_metrics
from ddptrain.train.data_input import micro_batch_weights, training_input
from ddptrain.train.early_stop import Verdict, build_early_stop
from ddptrain.train.evaluation import Evaluation, eval_samples, evaluate_loss, measured_forward
from ddptrain.train.hooks import Hooks, Observers
from ddptrain.train.log_window import LogWindow
from ddptrain.train.optim import build_optimizer
from ddptrain.train.parallel import by_name, is_sharded, load_full_state, local_norm, set_gradient_sync, unwrap_model
from ddptrain.train.precision import NonFiniteSteps, Precision
from ddptrain.train.preemption import HOOK_STOP, LEASE_LOST, NO_STOP, StopRequest
from ddptrain.train.rng import load_rng_state, rng_state, seed_everything
from ddptrain.train.schedules import PlannedSchedule, apply_lr, build_schedule, config_plan
from ddptrain.train.sync import Share, Sync, build_sync

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one optimizer step produced, as device tensors (loss: this rank's mean over its micro-batches; with
    labels, its share of the step's mean over target tokens, train/data_input.py: the ranks' mean is that mean)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor  # 1. when the gradient was non-finite and the update was skipped, else 0.
    seconds: float


class Trainer:
    """Trains one model with DDP on the ranks of `ctx`.

    `model` comes already wrapped by `sync.wrap` (run.py; train/sync/): constructing a Trainer runs no collective.
    sync: how the ranks agree on gradients and weights (None: the config's, built here; it wraps nothing then).
    """

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        model: nn.Module,
        train_set: Dataset[Any],
        val_set: Dataset[Any] | None,
        checkpointer: Checkpointer,
        metrics: MetricsWriter,
        progress: Progress,
        sync: Sync | None = None,
    ) -> None:
        self.cfg, self.ctx, self.checkpointer = cfg, ctx, checkpointer
        self.metrics, self.progress, self.train_set, self.val_set = metrics, progress, train_set, val_set
        self.ddp = model  # what the step calls: DDP (and torch.compile) around the user's module
        self.model = unwrap_model(model)
        self.model_name = model_name(self.model, cfg.model.target)
        self.custom = CustomMetrics(cfg.train.metrics, self.model_name)
        self.hooks = Hooks()  # the Python API's (run.train sets them)
        self.observers = Observers()  # the run's own (run.py attaches them)
        self.early_stop = build_early_stop(cfg.train.early_stop, has_validation=val_set is not None)
        self.accum = cfg.grad_accum_steps(ctx.world_size)
        self.optimizer = build_optimizer(self.model, cfg, ctx.device)
        self.scheduler = build_schedule(self.optimizer, cfg)
        self.precision = Precision(cfg.train.precision, ctx.device)
        self.nonfinite = NonFiniteSteps(ctx.device, counted=cfg.train.precision != "fp16")
        self.agreement = StopAgreement(ctx, cfg.dist.timeout_s)
        self.collate = build_collate(cfg.data, data_source(cfg.data).pad_id)  # for training and evaluation
        self.sampler, self.loader = training_input(cfg, ctx, train_set, self.collate)
        self.stream_record: Callable[[int], dict[str, Any]] | None = getattr(train_set, "stream_record", None)
        self.timer = StepTimer(ctx.device, ctx.is_distributed)
        self.timer.attach(self.ddp)  # stamps gradient buckets: backward compute vs all-reduce wait
        self.sync = sync if sync is not None else build_sync(cfg, ctx)
        self.step = 0
        self.window = LogWindow(ctx.device)  # the steps since the last logged one (saved with the state)
        self.world_size = ctx.world_size  # the ranks that took part in the last step
        self.last_loss: float | None = None  # what the last logged window and evaluation measured
        self.last_val_loss: float | None = None
        self.lease_lost_to: str | None = None  # a save rank 0 refused to commit: who took the folder's lease
        self.stopped_because: str | None = None  # an early stop or a hook's: why the run ended before max_steps
        self.stop_request: StopRequest | None = None  # fit()'s
        self.resumed_from: VerifiedCheckpoint | None = None
        self._batches: Iterator[Any] | None = None
        self.sync.attach(self)  # e.g. compresses the buckets the timer stamps

    def setup(self) -> None:
        """All ranks, in the run's set-up: the stop agreement's group (a collective only next to NCCL)."""
        self.agreement.setup()

    def after_resume(self) -> None:
        """All ranks, once the resume decided the first step: the sync begins (the in-place mode joins its quorum)."""
        self.sync.begin()

    def close(self) -> None:
        """Release what the trainer holds beyond the run's parts: the sync's (the in-place mode: its Manager)."""
        self.sync.close()

    def record_end(self, record: dict[str, Any]) -> None:
        """Write how this attempt ends (observe/endings.py's end record) into metrics.jsonl, as the sync's own."""
        self.sync.record_own(record)

    def logs_at(self, step: int) -> bool:
        """Whether step `step` is logged: the steps that read from the device (loss, norm, skipped count)."""
        return step % self.cfg.log.every_steps == 0 or step == self.cfg.train.max_steps

    # ---- the training step ----------------------------------------------------------------

    def next_batch(self) -> Any:
        """The next micro-batch of this rank; a new epoch (reshuffled) starts when one is used up."""
        if self.sampler.epoch_done:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._batches = None
        if self._batches is None:
            self._batches = iter(self.loader)
        return to_device(next(self._batches), self.ctx.device)

    def train_step(self) -> StepResult:
        """One optimizer step over this rank's share of the global batch (the sync's: `accum` micro-batches
        of the sampler's, or those the in-place mode's quorum gives it).

        Nothing here waits for the device: the norm stays a tensor and a non-finite step is skipped
        by the optimizer on the device. On logged steps only, train.on_nonfinite=stop reads the
        non-finite counter and raises before this step's update.
        """
        t0 = time.perf_counter()
        while True:  # until the sync commits an attempt: a discarded one changes nothing (no update, same data)
            share = self.sync.begin_step()
            self.timer.start()
            batches = self.batches_of(share)
            self.timer.lap("data")
            loss = self.sync.commit(self.forward_backward(batches, self.loss_weights(batches, share)))
            if loss is not None:
                break
            self.optimizer.zero_grad(set_to_none=True)
        self.sampler.advance()
        norm, skipped = self.apply_update()
        self.step += 1
        self.sync.after_update(self.step)
        return StepResult(loss, norm, skipped, time.perf_counter() - t0)

    def batches_of(self, share: Share) -> list[Any]:
        """This rank's micro-batches of the next global batch: the loader's next `accum`, or the share's span
        read by sample id (the same ids whichever rank takes them: a map-style dataset)."""
        if share.span is None:
            return [self.next_batch() for _ in range(self.accum)]
        if self.sampler.epoch_done:
            self.sampler.set_epoch(self.sampler.epoch + 1)
        (lo, hi), micro, start = share.span, self.cfg.data.micro_batch_size, self.sampler.position
        ids = self.sampler.ids(self.sampler.epoch, start + lo * micro, start + hi * micro).tolist()
        chunks = [ids[i : i + micro] for i in range(0, len(ids), micro)]
        # a map-style dataset: the sync that reads by id refused any other (check_in_place_data)
        return [to_device(self.collate([self.train_set[i] for i in chunk]), self.ctx.device) for chunk in chunks]

    def loss_weights(self, batches: list[Any], share: Share) -> Sequence[float | torch.Tensor] | torch.Tensor:
        """Each micro-batch's loss weight: the share's, or 1 / accum; batches with labels: the step's mean over the
        target tokens of the ranks that average their gradients."""
        if share.weight is not None:
            return [share.weight] * len(batches)
        weights = micro_batch_weights(batches, self.sync.step_ctx)
        return [1 / self.accum] * self.accum if weights is None else weights

    def forward_backward(
        self, batches: list[Any], weights: Sequence[float | torch.Tensor] | torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, micro-batch i's loss scaled by weights[i]; the
        gradients are reduced once, in the last backward. Returns the sum of the scaled losses (a device tensor)."""
        self.ddp.train()
        loss_sum = torch.zeros((), device=self.ctx.device)
        for micro, batch in enumerate(batches):
            # Gradients of the first micro-batches accumulate locally: no_sync() (DDP) or FSDP2's
            # gradient sync switch skips their all-reduce/reduce-scatter; the last backward reduces the sum once.
            last = micro == len(batches) - 1
            set_gradient_sync(self.ddp, last)
            self.sync.before_backward(last)  # e.g. the in-place mode's sum over the groups starts in the last
            sync = nullcontext() if last or not isinstance(self.ddp, DDP) else self.ddp.no_sync()
            with sync, self.precision.autocast():
                output = model_output(self.ddp, batch)
                loss = extract_loss(output, self.model_name) * weights[micro]
                self.custom.add(output, batch, 1 / len(batches))  # device sums: no host read
            self.timer.lap("forward")
            self.precision.backward(loss)
            self.timer.lap("backward")
            loss_sum += loss.detach()
        return loss_sum

    def apply_update(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, step the optimizer (unless the gradient is non-finite) and the schedule: (grad norm, skipped)."""
        self.precision.unscale_(self.optimizer)
        # After DDP's all-reduce every rank holds the same gradients, so every rank computes the
        # same norm: the finite check below is agreed on by all ranks without a collective. Under
        # FSDP the norm is a DTensor over gradient shards; local_norm all-reduces it to the same value.
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        norm = local_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        skipped = self.nonfinite.check(norm, self.step + 1)  # stays 0. with fp16: the scaler skips overflows
        if self.cfg.train.on_nonfinite == "stop" and self.logs_at(self.step + 1):
            self.nonfinite.stop_if_any(self.step + 1)
        self.precision.step(self.optimizer, skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.timer.lap("optimizer")
        return norm, skipped

    # ---- evaluation -------------------------------------------------------------------------

    def evaluate(self) -> Evaluation | None:
        """Mean validation loss and metrics over the first train.eval_batches x train.global_batch_size samples (any
        world size); a mixture's also each source's loss over as many of its own validation samples."""
        if self.val_set is None:
            return None
        train = self.cfg.train
        micro = self.cfg.data.micro_batch_size
        forward = measured_forward(self.precision, self.ctx.device, self.model_name, self.custom)

        def over(dataset: Dataset[Any]) -> Evaluation | None:
            n = eval_samples(train.eval_batches, train.global_batch_size, len(dataset))  # type: ignore[arg-type]
            return evaluate_loss(self.model, dataset, n, micro, self.ctx, forward, self.collate)

        result = over(self.val_set)
        if result is None or not isinstance(self.val_set, MixtureValidation):
            return result
        each = {name: over(dataset) for name, dataset in self.val_set.named}
        return replace(result, sources={name: e.loss for name, e in each.items() if e is not None})

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Training state (model, optimizer, schedule, scaler, data position); model and optimizer in the form the
        run's checkpoint format saves (full and rank-independent, or this rank's shards: DTensors under FSDP)."""
        model_state, optim_state = self.checkpointer.capture(self.model, self.optimizer)
        return {
            "model": model_state,
            "optimizer": optim_state,
            "trainer": {
                "step": self.step,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.state_dict(),
                "sampler": self.sampler.state_dict(),
                "world_size": self.ctx.world_size,
                "early_stop": self.early_stop.state_dict() if self.early_stop is not None else None,
                "log_window": self.window.state_dict(self.sync.per_rank),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict() (model and optimizer: full state; absent when the checkpoint's format restored
        them in place, in resume()); the data stream continues at the next global sample."""
        if "model" in state:
            optim_state = state["optimizer"]
            if is_sharded(self.model):  # a DDP checkpoint's optimizer state is keyed by index; FSDP's by name
                optim_state = by_name(optim_state, self.model, self.optimizer)
            load_full_state(self.model, self.optimizer, state["model"], optim_state)
        t = state["trainer"]
        self.step = t["step"]
        self.scheduler.load_state_dict(t["scheduler"])
        apply_lr(self.scheduler, self.optimizer, self.cfg.train.lr)
        self.precision.load_state_dict(t["scaler"])
        self.sampler.load_state_dict(t["sampler"])
        if self.early_stop is not None and t.get("early_stop"):  # older checkpoints have none
            self.early_stop.load_state_dict(t["early_stop"])
        # Older checkpoints have none: an empty window.
        self.window.load_state_dict(t.get("log_window"), self.ctx.rank, self.ctx.world_size)
        self._batches = None

    def save_checkpoint(self) -> None:
        """All ranks: save the current step (each rank writes its share of the state, and its own RNG); nothing
        where the sync writes nothing (the in-place mode's groups but one)."""
        if not self.sync.writes():
            return
        local: dict[str, Any] = {"rng": rng_state()}
        shared = self.state_dict()
        self.sync.checkpoint(shared, local)  # e.g. PowerSGD's error feedback: every rank's own
        self.checkpointer.save(self.step, shared, local)

    def resume(self, ckpt: VerifiedCheckpoint) -> None:
        """Load a verified checkpoint; RNGs come back per rank when the world size is unchanged.

        Any strategy resumes any checkpoint: a full state is sharded on load under FSDP; a checkpoint of
        per-rank shards fills this run's own form of the state (DTensor shards under FSDP, whole tensors
        under DDP) in place, its format reading the slices each rank needs, whatever world size saved it.
        """
        shared, local = self.checkpointer.restore(ckpt, self.model, self.optimizer)
        self.resumed_from = ckpt
        self.load_state_dict(self.sync.restore(shared, local))
        if local is not None:
            load_rng_state(local["rng"])
        else:
            # A new world size has no saved stream for this rank: derive one deterministically.
            seed_everything(self.cfg.run.seed + 7919 * self.step + self.ctx.rank)

    # ---- the loop ---------------------------------------------------------------------------

    def fit(self, stop_request: StopRequest | None = None, timeline: RecoveryTimeline | None = None) -> None:
        """Train until train.max_steps, logging, evaluating and checkpointing on the way.

        stop_request: a coordinated stop (Preempted or, after Ctrl-C, Interrupted once the checkpoint is
        committed). The ranks agree on it one
        step late (train.agreement), so every rank stops after the same step without blocking any. A hook's
        stop travels the same way; it and train.early_stop end the loop normally, with `stopped_because` set.
        timeline: a restart's marks; the first step completes it (the `recovery` event).
        """
        cfg, self.stop_request = self.cfg, stop_request
        if isinstance(self.scheduler, PlannedSchedule):
            at_floor = self.scheduler.follow(config_plan(cfg))  # e.g. a larger train.max_steps: no LR jump
            if at_floor is not None:
                log.warning(at_floor)
        if self.early_stop is not None and self.early_stop.stopped:  # resumed from the checkpoint it stopped at
            self.stopped_because = self.early_stop_reason()
            return
        while self.step < cfg.train.max_steps:
            self.observers.step_started(self.step + 1)
            result = self.train_step()
            if timeline is not None and timeline.waiting:
                timeline.first_step(self.step, result.loss, self.metrics.write)
            level = max(stop_request.level if stop_request is not None else NO_STOP, self.hooks.level)
            agreed = self.agreement.poll(level) if stop_request is not None or self.hooks.hooks else NO_STOP
            stop = agreed != NO_STOP
            self.observers.step_trained(self.step)
            if agreed == LEASE_LOST:  # at once: nothing of this step is logged or saved
                raise self._lease_lost(stop_request)
            self.window.add(result.loss, result.seconds)
            last = self.step == cfg.train.max_steps
            if self.logs_at(self.step):
                w = self.window
                self.log_train(w.loss / w.steps, w.steps, w.seconds, result.grad_norm)
                w.reset()
            self.observers.step_ended(self.step)
            verdict = self.evaluate_and_save(agreed, last)
            # The same verdict on every rank: an agreed hook stop, or a judgement of all-reduced evaluations.
            if verdict.stop and not last:
                self.stopped_because = self.hooks.agreed_reason(agreed) or self.early_stop_reason()
                break
            if stop and not last:
                self.agreement.wait()
                with self.observers.phase("checkpoint"):
                    self.finish_saves()
                raise stop_request.stop_error(self.step, agreed) if stop_request else Preempted(self.step, None)
        self.agreement.wait()
        with self.observers.phase("checkpoint"):
            self.finish_saves()

    def evaluate_and_save(self, agreed: int, last: bool) -> Verdict:
        """All ranks, after a step's logs: evaluate when due; save when due, at an agreed stop and at a new best
        evaluation (the observers hear of it first: the replica check precedes every save). Whether to stop
        here: a hook's agreed stop, train.early_stop's."""
        verdict = Verdict(improved=False, stop=agreed == HOOK_STOP)
        if self.cfg.train.eval_every and (self.step % self.cfg.train.eval_every == 0 or last):
            with self.observers.phase("evaluation"):
                verdict = self.log_eval(verdict)
        saving = self.checkpointer.due(self.step, last, agreed != NO_STOP or verdict.stop) or verdict.improved
        self.observers.state_settled(self.step, self.logs_at(self.step), saving)
        if saving:
            with self.observers.phase("checkpoint"):
                self.save_checkpoint()
                self.report_saves()
        return verdict

    def early_stop_reason(self) -> str:
        """Why train.early_stop ended the run (empty without one)."""
        return self.early_stop.reason() if self.early_stop is not None else ""

    def _lease_lost(self, stop_request: StopRequest | None) -> LeaseLost:
        """Every rank at the same step: another run took the folder's lease (rank 0 names it; the others may
        know it from a refused save)."""
        self.agreement.wait()  # every rank started the same all-reduces: finish them before leaving
        new_owner = stop_request.new_owner() if stop_request is not None else None
        return LeaseLost(str(self.cfg.run_dir), self.step, new_owner or self.lease_lost_to)

    def finish_saves(self) -> None:
        """All ranks: wait for the last save; retry it once if it failed; the state at this step is committed or
        CheckpointSaveError says which step is the newest safe one (the checkpoint policy decides). A process that
        writes nothing (sync.writes) only waits for its checkpointer."""
        self.checkpointer.wait()
        if not self.sync.writes():
            return
        self.report_saves()
        if self.lease_lost_to is not None:  # every rank holds the same results now
            raise LeaseLost(str(self.cfg.run_dir), self.step, self.lease_lost_to)
        if self.checkpointer.policy.final_retry_needed(self.step):
            log.warning("retrying the save of step %d, the state this run ends with", self.step)
            self.save_checkpoint()
            self.checkpointer.wait()
            self.report_saves()
        self.checkpointer.policy.require_final(self.step)

    def log_train(self, mean_loss: torch.Tensor, steps: int, seconds: float, grad_norm: torch.Tensor) -> None:
        """All ranks: average the window's loss over ranks; the observers see the record, rank 0 writes and shows it
        (the step's host reads). A process whose sync writes nothing keeps the loss only."""
        loss = self.sync.mean_over_ranks(mean_loss)
        skipped = self.nonfinite.take().count
        self.last_loss = loss
        if not self.sync.writes():
            return
        record: dict[str, Any] = {
            "step": self.step,
            "epoch": self.sampler.epoch,
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "world_size": self.world_size,
            "global_batch_size": self.cfg.train.global_batch_size,
            "grad_accum": self.accum,
            "step_time_s": seconds / steps,
            **self.timer.summary(),
            **self.sync.logged(),
        }
        if self.stream_record is not None:  # a mixture: how many samples each source gave so far
            record.update(self.stream_record(self.step))
        if skipped:
            record["skipped_steps"] = skipped
            log.warning("%d step(s) skipped for a non-finite gradient up to step %d", skipped, self.step)
        custom = self.custom.take(self.ctx, max(self.window.trained, 1))  # the steps its sums cover
        merge_metrics(record, custom, self.custom.origin)
        if custom:
            record["custom_metrics"] = sorted(custom)  # how ddptrain report tells them from the built-in keys
        self.observers.step_logged(record, steps, seconds)
        self.metrics.write("train", **record)
        self.hooks.call("on_log", record)
        shown: dict[str, Any] = {
            k: record[k]
            for k in ("loss", "lr", "samples_per_s", "tokens_per_s", "mfu", "outer_syncs", *custom)
            if k in record
        }
        self.progress.update(self.step, shown)

    def log_eval(self, verdict: Verdict) -> Verdict:
        """All ranks evaluate; rank 0 records val_loss and val_<name>; the hooks see the record and
        train.early_stop judges it (a new best is saved and marked). verdict: this step's so far."""
        result = self.evaluate()
        if result is None:
            return verdict
        self.last_val_loss = result.loss
        record: dict[str, Any] = {"step": self.step, "val_loss": result.loss}
        record.update({f"{SOURCE_VAL_LOSS}{name}": loss for name, loss in result.sources.items()})
        merge_metrics(record, {f"val_{k}": v for k, v in result.metrics.items()}, self.custom.origin)
        self.metrics.write("eval", **record)
        shown = "  ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step")
        log.info("step %6d  %s", self.step, shown, extra=self.sync.console_extra())
        self.hooks.call("on_eval", record)
        if self.early_stop is None:
            return verdict
        judged = self.early_stop.observe(record, self.step)
        if judged.improved:
            metric = self.early_stop.cfg.metric
            self.checkpointer.mark_best(self.step, {"metric": metric, "value": record[metric]})
        return Verdict(judged.improved, judged.stop or verdict.stop)

    def report_saves(self) -> None:
        """Record finished saves; the checkpoint policy then decides whether a failure stops the run."""
        for r in self.checkpointer.finished():
            if r.lease_lost is not None:
                # Rank 0 refused to commit: not a failed save, nothing to report. Its lease flag is up, so the stop
                # agreement stops every rank at one step (an async result may reach the ranks at different steps).
                self.lease_lost_to = r.lease_lost
                continue
            self._report_save(r)
            self.checkpointer.policy.judge(r)

    def _report_save(self, r: SaveResult) -> None:
        if r.ok:
            record = {"event": "checkpoint", "step": r.step, "blocked_s": r.blocked_s, "total_s": r.total_s}
            self.metrics.write("event", **record, path=str(r.path))
            self.hooks.call("on_checkpoint", {**record, "path": str(r.path)})
            log.info("checkpoint step %d committed (%.2fs, loop blocked %.3fs)", r.step, r.total_s, r.blocked_s)
            return
        self.metrics.write("event", event="checkpoint_failed", step=r.step, error=r.error)
        log.error("checkpoint at step %d was not committed: %s; earlier checkpoints are kept", r.step, r.error)
