"""An optimizer and a schedule the package does not define, used through optim.target / schedule.target."""

from __future__ import annotations

from typing import Any

import torch


def build_sgd(param_groups: list[dict[str, Any]], momentum: float = 0.0) -> torch.optim.Optimizer:
    """Plain SGD (not fused: it cannot skip a step on the device, so the trainer reads the flag)."""
    return torch.optim.SGD(param_groups, momentum=momentum)


def build_step_lr(optimizer: torch.optim.Optimizer, max_steps: int, drops: int = 2) -> torch.optim.lr_scheduler.StepLR:
    """Halve the LR `drops` times, evenly over the run."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, max_steps // (drops + 1)), gamma=0.5)


def not_an_optimizer(param_groups: list[dict[str, Any]]) -> object:
    """A factory returning the wrong thing."""
    return object()
