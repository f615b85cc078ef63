"""DDP's full optimizer state under FSDP: keyed by parameter name instead of index.

A DDP run saves `optimizer.state_dict()`, keyed by parameter index; FSDP's set_optimizer_state_dict
takes state keyed by parameter name (FQN). Both runs build the optimizer over the same parameters
in the same order (train/optim.py), so index k is the k-th parameter of the param groups, in order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


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
