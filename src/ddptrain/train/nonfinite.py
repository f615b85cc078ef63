"""Non-finite gradients, counted on the device and read only when the loop reads the device anyway.

Each step turns its gradient norm into a 0./1. `found_inf` tensor (what GradScaler calls it) that
the optimizer step obeys on the device (optim.step_unless_nonfinite), and adds it to a counter that
also keeps the first such step and its norm. The host reads the counter on logged steps: the
metrics' `skipped_steps`, and train.on_nonfinite=stop, which therefore stops every rank at the
first logged step at or after a non-finite one (every rank computes the same all-reduced norm, so
they all see it at the same step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddptrain.errors import NonFiniteError


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
