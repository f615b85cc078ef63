"""Mixed precision: autocast for bf16/fp16, and a GradScaler for fp16 (whose range needs it)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

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

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step; with fp16 the scaler skips steps whose gradients overflowed."""
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (empty unless fp16)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scaler's state."""
        if state:
            self.scaler.load_state_dict(state)
