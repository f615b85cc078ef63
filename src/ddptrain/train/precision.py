"""Mixed precision and its non-finite gradients.

Autocast for bf16/fp16, and a GradScaler for fp16 (whose range needs it).

Non-finite gradients (NonFiniteSteps) are counted on the device and read only when the loop reads the device
anyway. Each step turns its gradient norm into a 0./1. `found_inf` tensor (what GradScaler calls it) that the
optimizer step obeys on the device (optim.step_unless_nonfinite), and adds it to a counter that
also keeps the first such step and its norm. The host reads the counter on logged steps: the
metrics' `skipped_steps`, and train.on_nonfinite=stop, which therefore stops every rank at the
first logged step at or after a non-finite one (every rank computes the same all-reduced norm, so
they all see it at the same step).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ddptrain.errors import NonFiniteError
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


@dataclass
class Skipped:
    """What the counter held when read: skipped steps, and the first one's step and gradient norm."""

    count: int
    first_step: int
    first_norm: float


class NonFiniteSteps:
    """Counts non-finite steps on the device; `counted=False` (fp16: the GradScaler decides) counts none."""

    def __init__(self, device: torch.device, counted: bool) -> None:
        self.counted = counted
        self._never = torch.zeros((), device=device)
        # [count, first step, first norm] in one tensor: one read brings all three to the host.
        self._state = torch.zeros(3, dtype=torch.float64, device=device)

    def check(self, norm: torch.Tensor, step: int) -> torch.Tensor:
        """found_inf of this step's norm (1. when NaN/inf), recorded under `step`; no host read."""
        if not self.counted:
            return self._never
        found = torch.logical_not(torch.isfinite(norm)).float()
        count, first_step, first_norm = self._state.unbind()
        is_first = (count == 0) & (found > 0)
        self._state = torch.stack(
            [
                count + found,
                torch.where(is_first, float(step), first_step),
                torch.where(is_first, norm.double(), first_norm),
            ]
        )
        return found

    def take(self) -> Skipped:
        """Read (a host sync) and reset the counter."""
        count, first_step, first_norm = self._state.tolist()
        self._state = torch.zeros_like(self._state)
        return Skipped(int(count), int(first_step), first_norm)

    def stop_if_any(self, step: int) -> None:
        """Raise NonFiniteError (on every rank alike) when a step since the last read was non-finite."""
        skipped = self.take()
        if skipped.count:
            seen = f" (checked at step {step})" if skipped.first_step != step else ""
            raise NonFiniteError(f"non-finite gradient norm ({skipped.first_norm}) at step {skipped.first_step}{seen}")
