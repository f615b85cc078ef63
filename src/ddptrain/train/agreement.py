"""What the ranks must agree on, and how they agree without waiting for each other.

A stop (StopAgreement): an all-reduce read one step late, so that no step waits for it.

After each step every rank starts an asynchronous MAX all-reduce of its "stop requested" flag
and reads the result of the one it started after the previous step, which finished long ago.
Every rank starts and reads the same all-reduces at the same steps, so every rank learns of a
request at the same step: one step after the step during which the first rank saw it.

The flag lives in host memory and travels on a gloo group (the training group when the backend
is gloo, a group of its own next to NCCL): reading it never waits for the accelerator.

The replica groups of the in-place mode agree on their recipe and state as numbers a sum can carry.

The recipe (recipe_of: what is trained) is checked twice before a group trains with the others: a joining
group reads the donor's recipe before it receives a byte of its state (train/in_place_transport.py), and
every new membership shows each group's recipe and standing in a sum before its first step (the in-place
Trainer's `admit`). The job's recipe is that of the groups standing highest: those that trained in the job
(a committed step in their process, or a verified heal from the job), then those resuming from a checkpoint
of the run folder saved with their own recipe, then the rest (the first quorum on a fresh folder); the most
common among them, a tie going to the lowest-ranked group's. The state's fingerprint is shown on a step where
the membership changed or a group healed. Values are 48-bit integers in float64 (exact).
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


IN_JOB, FROM_FOLDER, NEW = 2.0, 1.0, 0.0  # a group's standing when the job's recipe is chosen (module docstring)
_RECIPE_PARTS = "model, train, optim, schedule, data.micro_batch_size, run.seed or the data"


def recipe_of(config: dict[str, Any], identity: dict[str, Any]) -> str:
    """SHA-256 (hex) of what must be the same in every group: the model, training and optimizer settings, the
    micro-batch, the seed, and the run's identity (the data's content, the model's kind). config: the resolved
    config as a checkpoint's manifest stores it; identity: the Checkpointer's (a manifest's)."""
    data, run = config.get("data"), config.get("run")
    recipe = {
        "sections": {name: config.get(name) for name in ("model", "train", "optim", "schedule")},
        "micro": data.get("micro_batch_size") if isinstance(data, dict) else None,
        "seed": run.get("seed") if isinstance(run, dict) else None,
        "identity": identity,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()


def recipe_slot(recipe: str) -> float:
    """A recipe as a slot value of a sum."""
    return _as_slot(int(recipe[:16], 16))


def another_recipe(group: int, job: list[int]) -> ConfigError:
    """The one line a group of another recipe than the job's exits with (exit 2)."""
    return ConfigError(
        f"replica group {group} trains another recipe than groups {job}, the job's ({_RECIPE_PARTS} differ): it "
        "left before healing or training anything; start it with the job's config"
    )


def job_outsiders(
    recipes: list[float], standings: list[float], groups: list[int], group: int, mine: float
) -> list[int]:
    """The groups (ids, in quorum order) whose recipe is not the job's (module docstring); another_recipe (a
    ConfigError) when this group is one of them."""
    top = max(standings)
    job = Counter(r for r, s in zip(recipes, standings, strict=True) if s == top).most_common(1)[0][0]
    if mine != job:
        raise another_recipe(group, [g for g, r in zip(groups, recipes, strict=True) if r == job])
    return [g for g, r in zip(groups, recipes, strict=True) if r != job]


def state_fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    """The model's and optimizer's exact digest (observe/digest.py, the replica check's) as a slot value."""
    digests = state_digests(named_state(model, optimizer), device)
    return _as_slot(int(combine(digests).item()))


def differing_states(fingerprints: list[float], groups: list[int]) -> list[int]:
    """The groups (ids) whose state differs from the lowest-ranked group's: they trained apart (two quorums at
    start-up) or their heal went wrong, and heal again from that group's line."""
    return [g for g, f in zip(groups, fingerprints, strict=True) if f != fingerprints[0]]
