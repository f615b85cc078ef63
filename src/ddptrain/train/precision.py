"""Mixed precision: autocast for bf16/fp16, and a GradScaler for fp16 (whose range needs it)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ddptrain.train.optim import step_unless_nonfinite

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Owns the autocast context and the loss scaler; fp32 makes both no-ops."""

    def __init__(self, mode: str, device: torch.device) -> None:
        self.mode = mode
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")

    def autocast(self) -> AbstractContextManager[Any]:
        """The forward-pass context: lower-precision matmuls, fp32 master weights."""
        if self.mode == "fp32":
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.mode])

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the (possibly scaled) loss."""
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale before clipping or inspecting them."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """Optimizer step, skipped on the device when found_inf is 1.

        With fp16 the scaler decides instead: it skips steps whose gradients overflowed and adapts
        the scale (both on the device for optimizers that take found_inf, like the fused AdamW).
        """
        if self.scaler.is_enabled():
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            step_unless_nonfinite(optimizer, found_inf)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (empty unless fp16)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scaler's state."""
        if state:
            self.scaler.load_state_dict(state)
