"""What the replica groups of the in-place mode must agree on, as numbers the step's sum can carry.

Each group's rank 0 puts its numbers in its slot of the step's sum (train/in_place_trainer.py), so every
rank sees every group's: the recipe (what is trained) on every step; the state's fingerprint on a step
where the membership changed or a group healed. Values are 48-bit integers in float64 (exact).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from ddptrain.config import Config
from ddptrain.errors import ConfigError
from ddptrain.observe.digest import combine, named_state, state_digests

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
