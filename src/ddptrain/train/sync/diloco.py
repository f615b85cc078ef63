"""DiLoCo (arXiv 2311.08105): groups of ranks train apart for H steps, then agree on their weights in one outer step.

Groups: train.diloco.groups of consecutive ranks (0: one group per node, torchrun's LOCAL_WORLD_SIZE ranks). Inside
a group the ranks train with DDP over the group's own process group, or with dist.strategy=fsdp sharded over it by
FSDP2 (gradient accumulation as always); the groups exchange nothing between outer syncs. After every H-th step
(train.diloco.every_steps) and the run's last one (train.max_steps), each rank, with the counterparts of its index in
the other groups (under FSDP on its local shards: diloco_shards.py):

  pseudo-gradient   d = global - local                      (one flat buffer: the trainable parameters)
  mean              d = sum over the groups of d / groups   (the only bytes that cross between groups: in
                                                            train.diloco.outer_dtype, outer_dtype.py)
  outer step        SGD with Nesterov momentum (outer_lr, outer_momentum) on the global weights, d as gradient
  local := global

With train.diloco.fragments = P (streaming DiLoCo, fragments.py) each sync does this for the fragments due at that
step only: one outer SGD over every global weight, the others without a gradient, so each fragment's momentum
moves at its own syncs only, as P optimizers would. With train.diloco.delay_steps = tau > 0 (streaming DiLoCo's
overlap) a fragment's pseudo-gradient is computed and its exchange launched (asynchronously) at its sync step, the
next tau inner steps run while it travels, and after step + tau the exchange is waited for (the time blocked on the
link, outer_sync_s), the outer step applied and the fragment's local weights replaced by its new global ones (the
tau steps' own progress on that fragment is dropped: exact and simple; fragments.py's sync_plan has the schedule).

Data: the sampler gives each rank its share of every global batch as it does without DiLoCo, so the groups together
take each global batch once and a group train.global_batch_size / groups samples per inner step.
State: the global weights and the outer momentum are the same on every rank; the local weights, the inner optimizer
and the fp16 loss scale are each group's own. A checkpoint holds the global weights as its `model` (what eval,
export and generate read: the weights every group shares, and at an outer sync every group's own) and the outer
optimizer as its `optimizer`; each rank's `diloco-rank<r>.pt` holds its local weights, inner optimizer and loss
scale, and a sync in flight when it was taken (its fragments and this rank's payload, launched again by begin() at
a resume), so a resume at any step, mid-interval or mid-sync too, is bit for bit the uninterrupted run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddptrain.checkpoint.formats.base import DILOCO_STATE
from ddptrain.config import Config
from ddptrain.config.train import DiLoCoConfig, outer_payload_bytes
from ddptrain.dist import DistContext
from ddptrain.errors import CheckpointError, ConfigError
from ddptrain.ft_env import FaultToleranceEnv
from ddptrain.train.optim import load_optimizer_state
from ddptrain.train.parallel import is_sharded
from ddptrain.train.sync.base import Loop
from ddptrain.train.sync.diloco_shards import (
    as_dtensor,
    as_dtensors,
    full,
    full_shape,
    local_shape,
    local_shard,
    local_tree,
    map_optimizer_state,
    shard_of,
)
from ddptrain.train.sync.every_step import EveryStep
from ddptrain.train.sync.fragments import split_fragments, sync_plan
from ddptrain.train.sync.outer_dtype import Exchange, start

log = logging.getLogger(__name__)


def pseudo_gradient(global_params: list[torch.Tensor], local_params: list[torch.Tensor]) -> torch.Tensor:
    """global - local of every parameter, flat in parameter order (fp32: what the groups all-reduce)."""
    return torch.cat([(g - p.detach()).flatten().float() for g, p in zip(global_params, local_params)])


def outer_update(outer: torch.optim.Optimizer, global_params: list[torch.Tensor], mean: torch.Tensor) -> None:
    """The outer optimizer's step on the global weights with the groups' mean pseudo-gradient `mean` as their
    gradient (flat, in parameter order)."""
    with torch.no_grad():
        for g, d in zip(global_params, torch.split(mean, [g.numel() for g in global_params])):
            g.grad = d.view_as(g).to(g.dtype)
        outer.step()
        for g in global_params:
            g.grad = None


def outer_optimizer(params: list[torch.Tensor], cfg: DiLoCoConfig) -> torch.optim.SGD:
    """SGD at outer_lr with Nesterov momentum outer_momentum (none at 0) over the global weights."""
    return torch.optim.SGD(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0)


SHAPE_BEFORE = {"fragments": 1, "delay_steps": 0}  # what checkpoints saved before a key of describe() was there meant


def _shape(sync: dict[str, Any]) -> str:
    """What a DiLoCo checkpoint must match, as its refusal says it."""
    saved = {**SHAPE_BEFORE, **sync}
    return (
        f"every_steps={saved['every_steps']}, {saved['groups']} group(s), fragments={saved['fragments']}, "
        f"delay_steps={saved['delay_steps']}"
    )


@dataclass
class InFlight:
    """An outer sync started and not applied yet: its fragments, the trainable parameters they hold, its exchange."""

    fragments: list[int]
    indices: list[int]
    exchange: Exchange

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it: the fragments and this rank's payload as sent, in its dtype."""
        return {"fragments": self.fragments, "sent": self.exchange.sent, "dtype": self.exchange.dtype}


class DiLoCo(EveryStep):
    """DDP (or FSDP) inside each group every step (dist.grad_compression=fp16 compresses it), an outer step across
    the groups every train.diloco.every_steps steps; see the module docstring."""

    def __init__(self, cfg: Config, ctx: DistContext, ft: FaultToleranceEnv | None = None) -> None:
        super().__init__(cfg, ctx, ft)
        assert cfg.train.diloco is not None  # Config.sync_kind picks DiLoCo only then
        self.diloco = cfg.train.diloco
        self.groups = self.diloco.group_count(ctx.world_size, ctx.local_world_size)
        self.size = ctx.world_size // self.groups  # ranks per group
        self.group, self.index = divmod(ctx.rank, self.size)  # this rank's group, and its index in it
        self.inner = ctx  # the group's ranks, once setup() made its process group (one process: the process)
        self.across: dist.ProcessGroup | None = None  # this rank and its counterparts in the other groups
        self.names: list[str] = []
        self.slots: dict[str, int] = {}  # every name of a trainable parameter (a tied one's too): its index
        self.local_params: list[torch.Tensor] = []  # the trainable parameters (DTensors under FSDP)
        self.global_params: list[torch.Tensor] = []  # their global weights (this rank's shards under FSDP)
        self.outer: torch.optim.SGD | None = None
        self.fragments: list[range] = []  # each fragment's indices into the trainable parameters
        self.syncs = 0  # outer syncs applied so far (checkpointed)
        self.in_flight: InFlight | None = None  # the sync started and not applied yet (delay_steps > 0)
        self.saved_flight: dict[str, Any] | None = None  # a checkpoint's sync in flight, launched again by begin()
        self.blocked_s = 0.0  # seconds blocked waiting for outer exchanges since the last logged step
        self.sent_bytes = 0  # this rank's payload bytes launched since the last logged step
        self.loaded = False  # whether restore() set the global weights

    @property
    def step_ctx(self) -> DistContext:
        """This rank's group: each step averages the gradients of the group's ranks only."""
        return self.inner

    def setup(self) -> None:
        """All ranks, in the same order: every group's process group, then every cross-group one (new_group calls)."""
        if not self.ctx.is_distributed:
            return
        timeout, backend = timedelta(seconds=self.cfg.dist.timeout_s), self.ctx.backend
        for g in range(self.groups):
            group = dist.new_group(list(range(g * self.size, (g + 1) * self.size)), timeout=timeout, backend=backend)
            if g == self.group:
                self.inner = replace(self.ctx, group=group, rank=self.index, world_size=self.size)
        for i in range(self.size):
            across = dist.new_group([g * self.size + i for g in range(self.groups)], timeout=timeout, backend=backend)
            if i == self.index:
                self.across = across

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP over the group's ranks (with dist.strategy=fsdp: sharded over them by FSDP2); ConfigError (exit 2,
        before anything is written) for more fragments than trainable parameter tensors."""
        count = sum(1 for p in model.parameters() if p.requires_grad)
        if self.diloco.fragments > count:
            raise ConfigError(
                f"train.diloco.fragments={self.diloco.fragments} is more than the model's {count} trainable "
                "parameter tensors: each fragment holds at least one"
            )
        return super().wrap(model)

    def attach(self, loop: Loop) -> None:
        """The group's compression (fp16), and the global weights with their outer optimizer (no collective)."""
        super().attach(loop)
        trainable = [(n, p) for n, p in loop.model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.local_params = [p for _, p in trainable]
        index = {id(p): i for i, p in enumerate(self.local_params)}
        every_name = loop.model.named_parameters(remove_duplicate=False)
        self.slots = {n: index[id(p)] for n, p in every_name if id(p) in index}
        self.global_params = [t.clone() for t in self.own(range(len(self.local_params)))]
        self.outer = outer_optimizer(self.global_params, self.diloco)
        # By the full sizes (a DTensor's numel): the same fragments on every rank, whatever its shards.
        self.fragments = split_fragments([p.numel() for p in self.local_params], self.diloco.fragments)
        whole = outer_payload_bytes(sum(t.numel() for t in self.global_params), "fp32")
        log.info(
            "train.diloco: %d fragment(s) in %s: %.4g MB per outer sync (the largest fragment) instead of %.4g MB",
            self.diloco.fragments, self.diloco.outer_dtype, self.sync_bytes / 1e6, whole / 1e6,
        )  # fmt: skip

    def own(self, indices: Iterable[int]) -> list[torch.Tensor]:
        """This rank's own weights of the trainable parameters `indices` (under FSDP its local shards), detached and
        sharing their storage: what the pseudo-gradient reads and a sync overwrites."""
        return [local_shard(self.local_params[i].detach()) for i in indices]

    def begin(self) -> None:
        """A fresh start (or model.init_from): the global weights are the first step's weights, the same everywhere.
        A resume whose checkpoint was taken with a sync in flight launches that exchange again (a collective across
        the groups: every rank resumed the same step, so every rank has the same one in flight)."""
        if not self.loaded:
            with torch.no_grad():
                for g, p in zip(self.global_params, self.own(range(len(self.local_params)))):
                    g.copy_(p)
        saved, self.saved_flight = self.saved_flight, None
        if saved is not None:
            fragments = [int(f) for f in saved["fragments"]]
            indices = [i for f in fragments for i in self.fragments[f]]
            numel = sum(self.global_params[i].numel() for i in indices)
            sent = saved["sent"].to(self.global_params[0].device)
            self.in_flight = InFlight(
                fragments, indices, Exchange(sent, saved["dtype"], numel, self.across, self.groups)
            )

    def after_update(self, step: int) -> None:
        """All ranks, after step `step`: apply the sync started delay_steps before, start those due at this step
        (with delay_steps 0: sync them at once), and at the last step sync every fragment not applied at it (each
        exchange a collective across the groups; fragments.py's sync_plan says which)."""
        d = self.diloco
        plan = sync_plan(step, d.every_steps, d.fragments, d.delay_steps, self.cfg.train.max_steps)
        if plan.apply:
            flight, self.in_flight = self.in_flight, None
            assert flight is not None and flight.fragments == plan.apply, (step, plan, flight)
            self.apply(flight)
        if plan.start:
            self.in_flight = self.launch(plan.start)
        if plan.now:
            self.apply(self.launch(plan.now))

    def launch(self, fragments: list[int]) -> InFlight:
        """Start the sync of `fragments`: this rank's pseudo-gradient of their trainable parameters, on its way to
        the other groups (in train.diloco.outer_dtype)."""
        indices = [i for f in fragments for i in self.fragments[f]]
        delta = pseudo_gradient([self.global_params[i] for i in indices], self.own(indices))
        exchange = start(delta, self.diloco.outer_dtype, self.across, self.groups)
        self.sent_bytes += exchange.sent.numel() * exchange.sent.element_size()
        return InFlight(fragments, indices, exchange)

    def apply(self, flight: InFlight) -> None:
        """Wait for the exchange of `flight` (the time blocked on the link), then the outer step on its global
        weights with the groups' mean pseudo-gradient, and its local weights := the global ones."""
        assert self.outer is not None
        if flight.exchange.sent.is_cuda:
            torch.cuda.synchronize(flight.exchange.sent.device)  # the inner step's queued compute is not the link's
        t0 = time.perf_counter()
        flight.exchange.wait()
        self.blocked_s += time.perf_counter() - t0
        global_params = [self.global_params[i] for i in flight.indices]
        outer_update(self.outer, global_params, flight.exchange.mean())
        with torch.no_grad():
            for g, p in zip(global_params, self.own(flight.indices)):
                p.copy_(g)
        self.syncs += 1

    @property
    def sync_bytes(self) -> int:
        """Bytes of one rank's payload in an outer sync of the largest fragment (all of them at the last step), in
        outer_dtype: fp32's all-reduce moves 2 (G - 1) / G of them over each rank's link, bf16's and int8's
        all-gather G - 1. Under FSDP this rank's shards of them."""
        sizes = [sum(self.global_params[i].numel() for i in f) for f in self.fragments] or [0]
        return outer_payload_bytes(max(sizes), self.diloco.outer_dtype)

    def describe(self) -> dict[str, Any]:
        """What a checkpoint's DiLoCo state must match at a resume."""
        return {
            "kind": "diloco",
            "every_steps": self.diloco.every_steps,
            "groups": self.groups,
            "fragments": self.diloco.fragments,
            "delay_steps": self.diloco.delay_steps,
        }

    def checkpoint(self, shared: dict[str, Any], local: dict[str, Any]) -> None:
        """Shared: the global weights as `model`, the outer optimizer as `optimizer`, the sync count; this rank's
        `diloco` object: its local weights, inner optimizer and loss scale, and the sync in flight if one is (its
        fragments and this rank's payload: a resume launches it again). Under FSDP the shared tensors are gathered
        full over the group (collectives, every rank of it in the same order) and the rank's own are its shards."""
        super().checkpoint(shared, local)
        assert self.outer is not None
        trainer = shared["trainer"]
        flight = self.in_flight.state() if self.in_flight is not None else None
        local[DILOCO_STATE] = {
            "model": local_tree(shared["model"]),
            "optimizer": local_tree(shared["optimizer"]),
            "scaler": trainer["scaler"],
            "in_flight": flight,
        }
        # A tied weight is in the state dict under each of its names: each name gets the global tensor.
        shared["model"] = {k: self.full_global(k, v) for k, v in shared["model"].items()}
        shared["optimizer"] = map_optimizer_state(self.outer.state_dict(), self.local_params, full, local_shape)
        record = {**self.describe(), "syncs": self.syncs, "strategy": self.cfg.dist.strategy}
        shared["trainer"] = {**trainer, "sync": record}

    def full_global(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The shared `model` entry `name` of the model's state dict (`value`): a trainable parameter's global
        weights, any other entry as it is; full tensors (under FSDP gathered over the group)."""
        i = self.slots.get(name)
        if i is None:
            return full(local_shard(value), value)
        return full(self.global_params[i], self.local_params[i])

    def restore(self, shared: dict[str, Any], local: dict[str, Any] | None) -> dict[str, Any]:
        """Global weights and outer optimizer from the shared state (under FSDP this rank's shards of them), and the
        shared state the Trainer loads with this rank's own weights, inner optimizer and loss scale in it (under FSDP
        loaded here, in place); CheckpointError (exit 2) for a checkpoint of another train.diloco.every_steps, group
        count, fragment count or delay_steps, of another world size or strategy (DDP or FSDP), or without DiLoCo."""
        assert self.outer is not None
        saved, own = self.check_saved(shared["trainer"].get("sync"), local)
        with torch.no_grad():
            for name, g, p in zip(self.names, self.global_params, self.local_params):
                g.copy_(shard_of(shared["model"][name], p))
        self.outer.load_state_dict(map_optimizer_state(shared["optimizer"], self.local_params, shard_of, full_shape))
        for group in self.outer.param_groups:  # the config's outer settings win (a documented change at resume)
            group.update(lr=self.diloco.outer_lr, momentum=self.diloco.outer_momentum)
            group.update(nesterov=self.diloco.outer_momentum > 0)
        self.syncs, self.loaded = int(saved["syncs"]), True
        self.saved_flight = own.get("in_flight")  # saved before delay_steps: none
        trainer = {**shared["trainer"], "scaler": own["scaler"]}
        if not is_sharded(self.loop.model):
            return {**shared, "model": own["model"], "optimizer": own["optimizer"], "trainer": trainer}
        model, optimizer = self.loop.model, self.loop.optimizer
        model.load_state_dict(as_dtensors(own["model"], model.state_dict()))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        load_optimizer_state(optimizer, map_optimizer_state(own["optimizer"], params, as_dtensor, local_shape))
        return {"trainer": trainer}  # model and optimizer loaded: the Trainer loads the rest

    def check_saved(
        self, saved: dict[str, Any] | None, local: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the checkpoint's DiLoCo record, this rank's own state) when this run can resume them; CheckpointError
        (exit 2) otherwise."""
        mine = self.describe()
        if saved is None or {k: saved.get(k, SHAPE_BEFORE.get(k)) for k in mine} != mine:
            had = _shape(saved) if saved else "no train.diloco"
            raise CheckpointError(
                f"cannot resume DiLoCo ({_shape(mine)}) from a checkpoint saved with {had}: restore those values, "
                "or train into a new folder (run.name=NEW_NAME)"
            )
        if local is None or DILOCO_STATE not in local:
            raise CheckpointError(
                "cannot resume DiLoCo at another world size: each rank's weights and inner optimizer are saved per "
                "rank (diloco-rank<r>.pt); resume with the world size that saved the checkpoint"
            )
        was, now = saved.get("strategy", "ddp"), self.cfg.dist.strategy  # saved before fsdp was allowed: ddp
        if was != now:
            raise CheckpointError(
                f"cannot resume DiLoCo under dist.strategy={now} from a checkpoint saved under dist.strategy={was}: "
                "each rank's own weights and inner optimizer (diloco-rank<r>.pt) are saved as that strategy holds "
                f"them (whole under ddp, shards under fsdp); resume with dist.strategy={was}, or start a new folder "
                "from its global weights (model.init_from)"
            )
        return saved, local[DILOCO_STATE]

    def logged(self) -> dict[str, Any]:
        """outer_syncs applied so far, outer_sync_bytes (one rank's payload in a sync of the largest fragment),
        outer_sent_bytes (this rank's payload bytes launched since the last logged step), outer_sync_s (blocked
        waiting for the exchanges since the last logged step), diloco_groups."""
        blocked, self.blocked_s = self.blocked_s, 0.0
        sent, self.sent_bytes = self.sent_bytes, 0
        return {
            "outer_syncs": self.syncs,
            "outer_sync_bytes": self.sync_bytes,
            "outer_sent_bytes": sent,
            "outer_sync_s": blocked,
            "diloco_groups": self.groups,
        }

    def replica_groups(self) -> list[list[int]]:
        """Each group's ranks (groups of several): they hold the same weights and inner optimizer at every step; the
        groups differ between outer syncs. None under FSDP: a group's ranks hold different shards."""
        if self.size == 1 or self.cfg.dist.strategy == "fsdp":
            return []
        return [list(range(g * self.size, (g + 1) * self.size)) for g in range(self.groups)]
