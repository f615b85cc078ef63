"""What the ranks must agree on, and how they agree without waiting for each other.

A stop (StopAgreement): an all-reduce read one step late, so that no step waits for it.

After each step every rank starts an asynchronous MAX all-reduce of its "stop requested" flag
and reads the result of the one it started after the previous step, which finished long ago.
Every rank starts and reads the same all-reduces at the same steps, so every rank learns of a
request at the same step: one step after the step during which the first rank saw it.

The flag lives in host memory and travels on a gloo group (the training group when the backend
is gloo, a group of its own next to NCCL): reading it never waits for the accelerator.

The replica groups of the in-place mode agree on their recipe and state as numbers the step's sum can carry.

Each group's rank 0 puts its numbers in its slot of the step's sum (train/in_place_trainer.py), so every
rank sees every group's: the recipe (what is trained) on every step; the state's fingerprint on a step
where the membership changed or a group healed. Values are 48-bit integers in float64 (exact).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddptrain.config import Config
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError
from ddptrain.observe.digest import combine, named_state, state_digests


class StopAgreement:
    """`poll(requested)` on every rank after every step: the same largest level on every rank at the same step.

    A level is a small non-negative integer (0: no stop requested); see train/preemption.py.
    """

    def __init__(self, ctx: DistContext, timeout_s: float) -> None:
        self.ctx, self.timeout_s = ctx, timeout_s
        self._group: dist.ProcessGroup | None = None
        # The all-reduce works on `_flag`; `_value` is a numpy view of the same host memory, so
        # reading it is a plain memory read, not a tensor operation.
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._value = self._flag.numpy()
        self._pending: dist.Work | None = None

    def setup(self) -> None:
        """All ranks: the group the flag travels on (a collective only next to NCCL: a new gloo group)."""
        if not self.ctx.is_distributed:
            return
        if self.ctx.backend == "gloo":
            self._group = self.ctx.group
        else:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    def poll(self, requested: int) -> int:
        """All ranks, once per step: the largest level any rank had requested by the previous poll.

        requested: this rank's level (a bool works: False 0, True 1).
        """
        if not self.ctx.is_distributed:
            return requested  # one process: nobody to agree with
        if self._group is None:
            raise RuntimeError("StopAgreement.poll() before setup(): the ranks could not agree")
        agreed = self.wait()
        self._value[0] = requested
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def wait(self) -> int:
        """Finish the all-reduce in flight (at the end of fit: every rank started the same ones)."""
        if self._pending is None:
            return 0
        self._pending.wait()
        self._pending = None
        return int(self._value[0])


_BITS = 48


def _as_slot(value: int) -> float:
    return float(value & ((1 << _BITS) - 1))


def recipe_fingerprint(cfg: Config, identity: dict[str, Any]) -> float:
    """What must be the same in every group: the model, training and optimizer settings, the micro-batch, the seed,
    and the run's identity (the data's content, the model's kind)."""
    recipe = {
        "sections": cfg.model_dump(mode="json", include={"model", "train", "optim", "schedule"}),
        "micro": cfg.data.micro_batch_size,
        "seed": cfg.run.seed,
        "identity": identity,
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).digest()
    return _as_slot(int.from_bytes(digest[:8], "big"))


def check_recipe(recipes: list[float], groups: list[int], group: int, mine: float) -> list[int]:
    """The groups (ids) whose recipe differs from most groups' (a tie: the lowest-ranked group's wins); ConfigError
    (exit 2, one line) when this group is one of them."""
    common = Counter(recipes).most_common(1)[0][0]
    odd = [g for g, r in zip(groups, recipes, strict=True) if r != common]
    if mine != common:
        same = [g for g, r in zip(groups, recipes, strict=True) if r == common]
        raise ConfigError(
            f"replica group {group} trains another recipe than groups {same} (model, train, optim, schedule, "
            "data.micro_batch_size, run.seed or the data differ): start it with the job's config"
        )
    return odd


def state_fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    """The model's and optimizer's exact digest (observe/digest.py, the replica check's) as a slot value."""
    digests = state_digests(named_state(model, optimizer), device)
    return _as_slot(int(combine(digests).item()))


def differing_states(fingerprints: list[float], groups: list[int]) -> list[int]:
    """The groups (ids) whose state differs from the lowest-ranked group's: they trained apart (two quorums at
    start-up) or their heal went wrong, and heal again from that group's line."""
    return [g for g, f in zip(groups, fingerprints, strict=True) if f != fingerprints[0]]
