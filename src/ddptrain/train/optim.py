"""The optimizer: parameter groups, AdamW or the user's factory, and a step skipped on the device.

The bring-your-own protocol: `optim.target: "my_pkg.mod:build_optimizer"` names a factory called
as `build_optimizer(param_groups, **optim.kwargs)` returning a `torch.optim.Optimizer`. The groups
are two dicts, matrices (with `weight_decay=train.weight_decay`) and everything else (biases,
norms: `weight_decay=0`), each with `lr=train.lr`: the schedule scales every group's lr.

A non-finite step is skipped without the host reading anything from the device: optimizers that
take GradScaler's `found_inf` tensor (torch's fused Adam, AdamW, SGD, Adagrad: the
`_step_supports_amp_scaling` flag) leave parameters and state untouched when it is 1. Any other
optimizer costs one read of that flag per step (as GradScaler itself does for such optimizers).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ddptrain.config import Config
from ddptrain.errors import ConfigError
from ddptrain.targets import import_target

# Group keys that describe how an optimizer computes, not what it learned: a checkpoint from
# another device or torch build must not switch the implementation the run was built with.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def param_groups(model: nn.Module, cfg: Config) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases and norms), every group at the peak lr."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.train.weight_decay, "lr": cfg.train.lr},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": cfg.train.lr},
    ]


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (fused on CUDA and CPU, so that a non-finite step is skipped on the device), or optim.target's."""
    groups = param_groups(model, cfg)
    if cfg.optim.target is None:
        fused = device.type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=cfg.train.betas, fused=fused)
    optimizer = import_target(cfg.optim.target, "optim.target")(groups, **cfg.optim.kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        got = type(optimizer).__name__
        raise ConfigError(f"optim.target={cfg.optim.target!r} returned {got}, not a torch Optimizer")
    return optimizer


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer takes a found_inf tensor and skips the update on the device."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """optimizer.step(), leaving parameters and state as they are when found_inf (a 0./1. tensor) is 1."""
    if not skips_on_device(optimizer):
        if not found_inf.item():  # the one host read an optimizer without found_inf support costs
            optimizer.step()
        return
    # The protocol GradScaler.step uses with these optimizers: attributes read by step().
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore a saved optimizer state, keeping this run's implementation (fused or not) per group.

    The saved groups' implementation keys are replaced before loading: torch places each state
    tensor (the fused kernels keep `step` on the parameter's device) by the saved groups' flags.
    """
    ours = [{k: g[k] for k in _IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    saved = [{**g, **mine} for g, mine in zip(state["param_groups"], ours)] + state["param_groups"][len(ours) :]
    optimizer.load_state_dict({**state, "param_groups": saved})
