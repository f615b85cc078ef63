"""The synchronization seam: how the ranks of a run agree on gradients and weights, behind one interface that the
one training step (`Trainer.train_step`) calls, whatever the mode.

A step, for every sync: this rank's share of the global batch (the sampler), forward and backward over its
micro-batches (the last backward reduces the gradients over the ranks of `step_ctx`, through the module `wrap`
built: DDP's all-reduce, FSDP's reduce-scatter; the others accumulate), the update (clip, optimizer, schedule),
then `after_update(step)` (DiLoCo: the outer step every H steps). Around the step:

setup()           run.py's step 4, all ranks, before the model is wrapped: the sync's own process groups
wrap(model)       run.py's step 4: the module the step calls (DDP broadcasts the group's first rank's weights)
attach()          once, when the Trainer is built (no collective): hooks on the wrapped module, copies of state
restore()         at a resume, before the Trainer loads the checkpoint's shared state: the sync's own state
begin()           all ranks, once the resume (or init_from) decided the first step's weights
checkpoint()      at every save: the sync adds its own state (shared or per rank) to what is saved
logged()          at every logged step: the sync's fields of the step's record
replica_groups()  the ranks that must hold identical state at every step (train/replicas.py checks them)

Every collective a sync runs is in one of these named steps, in the same order on every rank (run.py's docstring).
Kinds are declared once in config/kinds.py's SYNCS; `build_sync` builds the run's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ddptrain.config import Config
from ddptrain.config.kinds import SYNCS
from ddptrain.dist import DistContext
from ddptrain.observe.perf import StepTimer
from ddptrain.train.parallel import wrap_model
from ddptrain.train.replicas import replica_groups


class Sync:
    """Every-step synchronization as the base: the ranks of `ctx` reduce their gradients in every step's last
    backward (DDP/FSDP), keep no state of their own and hold identical replicas (as dist.strategy groups them)."""

    def __init__(self, cfg: Config, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx

    @property
    def step_ctx(self) -> DistContext:
        """The ranks whose gradients each step averages (the loss weights of SFT batches are counted over them)."""
        return self.ctx

    def setup(self) -> None:
        """All ranks, before wrap(): the sync's own process groups (collectives); none here."""

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the step calls: DDP over step_ctx's ranks, or the model sharded (train/parallel.py)."""
        return wrap_model(model, self.cfg, self.step_ctx)

    def attach(self, ddp: nn.Module, timer: StepTimer, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """When the Trainer is built (no collective): what the sync registers on the wrapped module; nothing here."""

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

    def replica_groups(self) -> list[list[int]]:
        """The groups of ranks that hold identical model and optimizer state after every step."""
        d = self.cfg.dist
        return replica_groups(self.ctx.world_size, d.strategy, d.shard_size or 1)


def build_sync(cfg: Config, ctx: DistContext) -> Sync:
    """The sync the config asks for (config/kinds.py's SYNCS), built without a collective."""
    kind: type[Sync] = SYNCS.load(cfg.sync_kind)
    return kind(cfg, ctx)
