"""The synchronization seam: how the ranks of a run agree on gradients and weights, behind one interface that the
one training step (`Trainer.train_step`) calls, whatever the mode.

A step, for every sync: `begin_step()` says which micro-batches of the global batch this rank takes (the sampler's
share; the in-place mode's quorum decides it), forward and backward over them (`before_backward(last)`; the last
backward reduces the gradients over the ranks of `step_ctx`, through the module `wrap` built: DDP's all-reduce,
FSDP's reduce-scatter; the others accumulate), `commit(loss)` (the step is kept, or discarded and tried again:
the in-place mode's vote), the update (clip, optimizer, schedule), then `after_update(step)` (DiLoCo: the outer
step every H steps). Around the step:

setup()           run.py's step 4, all ranks, before the model is wrapped: the sync's own process groups
wrap(model)       run.py's step 4: the module the step calls (DDP broadcasts the group's first rank's weights)
attach(loop)      once, when the Trainer is built (no collective): hooks on the wrapped module, copies of state
restore()         at a resume, before the Trainer loads the checkpoint's shared state: the sync's own state
begin()           all ranks, once the resume (or init_from) decided the first step's weights
checkpoint()      at every save: the sync adds its own state (shared or per rank) to what is saved
logged()          at every logged step: the sync's fields of the step's record
replica_groups()  the ranks that must hold identical state at every step (train/replicas.py checks them)
close()           when the run ends: what the sync holds beyond the run's parts

What the loop writes and shows also asks the sync (one process per job writes the folder unless the sync says
otherwise): writes(), mean_over_ranks()/per_rank() (the loss's host reads), console_extra(), event_fields(),
record_own().

Every collective a sync runs is in one of these named steps, in the same order on every rank (run.py's docstring).
Kinds are declared once in config/kinds.py's SYNCS; `build_sync` builds the run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from ddptrain.checkpoint import Checkpointer, VerifiedCheckpoint
from ddptrain.config import Config
from ddptrain.config.kinds import IN_PLACE, SYNCS
from ddptrain.dist import DistContext, all_gather_object, all_reduce_mean
from ddptrain.ft_env import FaultToleranceEnv
from ddptrain.observe.metrics import MetricsWriter
from ddptrain.observe.perf import StepTimer
from ddptrain.train.agreement import StopAgreement
from ddptrain.train.hooks import Observers
from ddptrain.train.parallel import wrap_model
from ddptrain.train.preemption import StopRequest
from ddptrain.train.replicas import replica_groups


@dataclass(frozen=True)
class Share:
    """Which micro-batches of the global batch this rank takes in a step."""

    span: tuple[int, int] | None = None  # micro-batches [lo, hi) of the global batch, read by sample id; None:
    # the sampler's share (the loader's next grad_accum micro-batches)
    weight: float | None = None  # each micro-batch's loss weight; None: 1 / grad_accum (or by target tokens)


SAMPLER_SHARE = Share()


class Loop(Protocol):
    """What a sync sees of the training loop it serves (the Trainer), given to attach()."""

    ddp: nn.Module  # what the step calls
    model: nn.Module  # the user's module
    optimizer: torch.optim.Optimizer
    timer: StepTimer
    metrics: MetricsWriter
    observers: Observers
    agreement: StopAgreement
    checkpointer: Checkpointer
    step: int  # optimizer steps taken
    world_size: int  # the ranks that took part in the last step (logged)
    accum: int  # this rank's micro-batches in the last step (logged)
    stop_request: StopRequest | None  # fit()'s
    resumed_from: VerifiedCheckpoint | None  # the checkpoint the run resumed from

    def state_dict(self) -> dict[str, Any]:
        """The whole training state (Trainer.state_dict)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load state_dict()."""

    def save_checkpoint(self) -> None:
        """All ranks: save the current step."""

    def report_saves(self) -> None:
        """Record finished saves."""

    def finish_saves(self) -> None:
        """All ranks: wait for the last save (retried once)."""


class Sync:
    """Every-step synchronization as the base: the ranks of `ctx` reduce their gradients in every step's last
    backward (DDP/FSDP), keep no state of their own and hold identical replicas (as dist.strategy groups them)."""

    loop: Loop  # set by attach()

    def __init__(self, cfg: Config, ctx: DistContext, ft: FaultToleranceEnv | None = None) -> None:
        """ft: this worker's replica group in the in-place mode (ft_env.py), which only its sync reads."""
        self.cfg, self.ctx, self.ft = cfg, ctx, ft

    @property
    def step_ctx(self) -> DistContext:
        """The ranks whose gradients each step averages (the loss weights of SFT batches are counted over them)."""
        return self.ctx

    def setup(self) -> None:
        """All ranks, before wrap(): the sync's own process groups (collectives); none here."""

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the step calls: DDP over step_ctx's ranks, or the model sharded (train/parallel.py)."""
        return wrap_model(model, self.cfg, self.step_ctx)

    def attach(self, loop: Loop) -> None:
        """When the Trainer is built (no collective): the loop the sync serves; what it registers on the wrapped
        module (loop.ddp): nothing here."""
        self.loop = loop

    def begin_step(self) -> Share:
        """All ranks, as an attempt at the next step starts: which micro-batches this rank takes (the sampler's)."""
        return SAMPLER_SHARE

    def before_backward(self, last: bool) -> None:
        """Before each backward of the step (`last`: the one whose gradients are reduced): nothing more here."""

    def commit(self, loss: torch.Tensor) -> torch.Tensor | None:
        """All ranks, after the step's last backward: the step's loss as the log window counts it (this rank's sum
        of its weighted losses), or None when the step is discarded (no update; the loop tries the next step
        again). Always kept here."""
        return loss

    def after_update(self, step: int) -> None:
        """All ranks, after optimizer step `step` (from 1): nothing more here."""

    def begin(self) -> None:
        """All ranks, once the first step's weights are decided (resumed, or model.init_from): nothing here."""

    def restore(self, shared: dict[str, Any], local: dict[str, Any] | None) -> dict[str, Any]:
        """At a resume: load the sync's state from a checkpoint's (shared, local) state; returns the shared state
        the Trainer then loads (as it is here). local is None when the checkpoint was saved at another world size."""
        return shared

    def checkpoint(self, shared: dict[str, Any], local: dict[str, Any]) -> None:
        """At a save: add the sync's state to the shared state and this rank's local objects; nothing here."""

    def logged(self) -> dict[str, Any]:
        """The sync's fields of a logged step's record (metrics.jsonl); none here."""
        return {}

    def writes(self) -> bool:
        """Whether this process logs the steps and saves the checkpoints of the job (rank 0 alone decides which
        of its ranks write): always here."""
        return True

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        """The mean of a rank's logged value over the ranks (a host read and a collective: logged steps only)."""
        return float(all_reduce_mean(self.ctx, value))

    def per_rank(self, value: torch.Tensor) -> list[float]:
        """Every rank's value of a scalar, in rank order (a collective: every rank calls it)."""
        return [float(v) for v in all_gather_object(self.ctx, float(value))]

    def console_extra(self) -> dict[str, bool] | None:
        """The logging `extra` of a line the job shows once on its console (start, val_loss, done): None, as
        rank 0 alone prints."""
        return None

    def event_fields(self) -> dict[str, Any]:
        """What the start and end records of this process say about who wrote them: nothing more here."""
        return {}

    def record_own(self, record: dict[str, Any]) -> None:
        """Write an event of this process's own (how it ends) into metrics.jsonl, with event_fields()."""
        self.loop.metrics.write("event", **record, **self.event_fields())

    def close(self) -> None:
        """Release what the sync holds beyond the run's parts: nothing here."""

    def replica_groups(self) -> list[list[int]]:
        """The groups of ranks that hold identical model and optimizer state after every step."""
        d = self.cfg.dist
        return replica_groups(self.ctx.world_size, d.strategy, d.shard_size or 1)


def build_sync(cfg: Config, ctx: DistContext, ft: FaultToleranceEnv | None = None) -> Sync:
    """The sync the config asks for (config/kinds.py's SYNCS), or the in-place mode's when this worker is one of its
    replica groups (ft), built without a collective."""
    kind: type[Sync] = SYNCS.load(IN_PLACE if ft is not None else cfg.sync_kind)
    return kind(cfg, ctx, ft)
