"""Replicas that must agree, do: silent corruption caught across data-parallel ranks before it is trained on or saved.

After every optimizer step the replicas of a data-parallel run hold bit-identical parameters and
optimizer state (the same averaged gradient, the same update). A rank whose memory or arithmetic
flips a bit trains on different weights from then on, and nothing else notices. So every
`log.replica_check_every` steps (on the first logged step at or after each multiple: logged steps
read from the device anyway) and before every checkpoint, every rank digests its state on the
device (observe/digest.py) and the ranks all-gather one int64 each. Only when a replica group
disagrees, a second all-gather of the per-tensor digests names the tensors. Every rank sees the
same gathered values and so decides the same: the collectives are the same on every rank.

Replicas: DDP, all ranks; HSDP, the ranks holding the same shard (rank % dist.shard_size); FSDP
holds no replicas (every rank a different shard): not checked.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddptrain.dist import DistContext
from ddptrain.errors import TrainingStopped
from ddptrain.observe.digest import combine, named_state, state_digests
from ddptrain.review.verdict import FORENSICS
from ddptrain.safe_files import ensure_dir, write_text_replace

log = logging.getLogger(__name__)


class ReplicaDivergence(TrainingStopped):
    """Replicas that must hold the same state do not: every rank stops at once, before anything is committed (exit 1)."""


@dataclass
class Split:
    """One replica group's disagreement: who differs, and from whom (majority None: no majority)."""

    group: list[int]
    odd: list[int]
    majority: list[int] = field(default_factory=list)
    tensors: dict[int, list[str]] = field(default_factory=dict)  # rank -> tensors differing from the majority


def replica_groups(world_size: int, strategy: str, shard_size: int) -> list[list[int]]:
    """The ranks that must hold the same state, by group (none under fsdp, or alone)."""
    if world_size < 2 or strategy == "fsdp":
        return []
    shard = shard_size if strategy == "hsdp" else 1
    groups = [[r for r in range(world_size) if r % shard == s] for s in range(shard)]
    return [g for g in groups if len(g) > 1]


def splits(values: list[int], groups: list[list[int]]) -> list[Split]:
    """The groups whose ranks' values differ: the ranks outside a strict majority, or every rank when none has one."""
    out = []
    for group in groups:
        counts = Counter(values[r] for r in group)
        if len(counts) == 1:
            continue
        value, n = counts.most_common(1)[0]
        if 2 * n > len(group):
            majority = [r for r in group if values[r] == value]
            out.append(Split(group, [r for r in group if values[r] != value], majority))
        else:
            out.append(Split(group, list(group)))
    return out


def name_tensors(split: Split, per_rank: list[list[int]], names: list[str]) -> None:
    """Fill split.tensors: each odd rank's tensors that differ from the majority (from the other ranks, with none)."""
    for r in split.odd:
        others = split.majority or [o for o in split.group if o != r]
        split.tensors[r] = [
            name for i, name in enumerate(names) if any(per_rank[r][i] != per_rank[o][i] for o in others)
        ]


def _ranks(ranks: list[int], hosts: tuple[str, ...]) -> str:
    return ", ".join(f"{r} on {hosts[r] if r < len(hosts) else '?'}" for r in ranks)


def verdict_line(split: Split, step: int, agreed: int | None, hosts: tuple[str, ...]) -> str:
    """The one line a divergence is reported with."""
    since = f"they agreed at step {agreed}" if agreed is not None else "first check of this run"
    first = next(iter(split.tensors.values()), [])
    shown = ", ".join(first[:3]) + (f" and {len(first) - 3} more" if len(first) > 3 else "")
    if split.majority:
        s = "s" if len(split.odd) == 1 else ""
        who = f"rank {_ranks(split.odd, hosts)} differ{s} from the majority (rank {_ranks(split.majority, hosts)})"
        tie = ""
    else:
        who = f"ranks {_ranks(split.odd, hosts)} differ"
        tie = (
            "; with no majority which one is wrong cannot be told: the last checkpoint, saved when they agreed, "
            "holds the committed state both continued"
        )
    # Every save is preceded by a check: none after the last agreeing one can have been committed.
    kept = f"no checkpoint after step {agreed} is committed" if agreed is not None else "this attempt committed none"
    return (
        f"replicas diverged by step {step} ({since}): {who}, in {shown or 'no single tensor'}{tie}; "
        f"{kept}: rerun to resume from the last checkpoint"
    )


class ReplicaCheck:
    """Every rank: digest, exchange, judge; `check` returns the same verdict on every rank (the Trainer stops them)."""

    def __init__(self, ctx: DistContext, every: int, groups: list[list[int]]) -> None:
        self.ctx, self.every = ctx, every
        self.groups = groups if every else []  # 0 turns the check off, also before checkpoints
        self.agreed: int | None = None  # the last step every replica group agreed at, and rank 0's digest then
        self.agreed_digest: int | None = None
        self._next = every

    def due(self, step: int, logged: bool) -> bool:
        """Whether `step` is a check step: the first logged step at or after each multiple of `every`."""
        if not self.groups or not self.every or not logged or step < self._next:
            return False
        self._next = (step // self.every + 1) * self.every
        return True

    def check(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """All ranks (when replicas exist): compare digests; None when every group agrees, else the verdict record."""
        if not self.groups:
            return None
        tensors = named_state(model, optimizer)
        digests = state_digests(tensors, self.ctx.device)
        values: list[int] = self._gather(combine(digests)).tolist()  # the one host read of a check step
        found = splits(values, self.groups)
        if not found:
            self.agreed, self.agreed_digest = step, values[0]
            return None
        per_rank = self._gather(digests).reshape(self.ctx.world_size, -1).tolist()  # the second round
        names = [name for name, _ in tensors]
        for split in found:
            name_tensors(split, per_rank, names)
        line = verdict_line(found[0], step, self.agreed, self.ctx.hosts)
        record: dict[str, Any] = {
            "event": "replica_divergence",
            "step": step,
            "agreed_step": self.agreed,
            "agreed_digest": self.agreed_digest,
            "digests": values,
            "verdict": line,
            "splits": [
                {
                    "group": s.group,
                    "ranks": s.odd,
                    "majority": s.majority,
                    "hosts": [self.ctx.hosts[r] if r < len(self.ctx.hosts) else "?" for r in s.odd],
                    "tensors": {str(r): t for r, t in s.tensors.items()},
                }
                for s in found
            ],
        }
        return record

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(self.ctx.world_size)]
        dist.all_gather(out, t, group=self.ctx.group)
        return torch.cat(out).cpu()


class ReplicaGuard:
    """The replica check as an observer of the loop (train/hooks.py): on check steps and before every save, every
    rank compares; a divergence is recorded (metrics.jsonl through `write`, the forensics file by rank 0) and
    stops every rank (ReplicaDivergence)."""

    def __init__(
        self,
        check: ReplicaCheck,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        write: Callable[..., None],
        stacks: Path,
    ) -> None:
        self.check, self.model, self.optimizer, self.write, self.stacks = check, model, optimizer, write, stacks

    def state_settled(self, step: int, logged: bool, saving: bool) -> None:
        """All ranks, with the step's state final: check when due and before every save (a checkpoint is never
        committed from replicas that disagree)."""
        if not (self.check.due(step, logged) or saving):
            return
        record = self.check.check(step, self.model, self.optimizer)
        if record is None:
            return
        self.write("event", **record)
        if self.check.ctx.is_main:
            write_forensics(self.stacks, record)
        raise ReplicaDivergence(record["verdict"])


def write_forensics(stacks_dir: Path, record: dict[str, Any]) -> None:
    """Rank 0: the verdict beside the hang forensics, for `ddptrain triage` (review/verdict.py reads it)."""
    try:
        ensure_dir(stacks_dir, stacks_dir.parent)  # a real folder in run.dir, never a planted link
        write_text_replace(stacks_dir / FORENSICS, json.dumps(record, indent=1) + "\n")  # a link there is replaced
    except OSError as e:  # the divergence still stops the run: its verdict is in metrics.jsonl and the log
        log.warning("cannot write %s (%s)", stacks_dir / FORENSICS, e.strerror or e)
