"""Model and optimizer state across strategies: DCP checkpoints (dcp writer) and DDP's full state under FSDP.

A DDP run saves `optimizer.state_dict()`, keyed by parameter index; FSDP's set_optimizer_state_dict
takes state keyed by parameter name (FQN). Both runs build the optimizer over the same parameters
in the same order (train/optim.py), so index k is the k-th parameter of the param groups, in order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ddptrain.checkpoint import Checkpointer, VerifiedCheckpoint


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state as this rank's shards (DTensors under FSDP, whole tensors otherwise), keyed by name."""
    return get_state_dict(model, optimizer)


def load_dcp(
    checkpointer: Checkpointer, ckpt: VerifiedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """All ranks: model and optimizer from a dcp checkpoint, in this run's form; DCP reads the slices each needs.

    The template is get_state_dict's: it initialises a fresh optimizer's state, so every key exists to be filled.
    """
    model_state, optim_state = get_state_dict(model, optimizer)
    checkpointer.load_sharded(ckpt, {"model": model_state, "optimizer": optim_state})  # fills them in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def by_name(optim_state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An index-keyed optimizer state (DDP's) keyed by parameter name instead; a named one as it is."""
    if not any(isinstance(k, int) for k in optim_state.get("state", {})) and not any(
        isinstance(p, int) for g in optim_state.get("param_groups", []) for p in g.get("params", [])
    ):
        return optim_state
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[k]: v for k, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [order[k] for k in g["params"]]} for g in optim_state["param_groups"]],
    }
