"""Every-step synchronization: DDP all-reduces (FSDP reduce-scatters) the gradients in every step's last backward,
through dist.grad_compression's hook when one is set (train/compression.py). PowerSGD's per-rank state is saved as
each rank's `grad_compression-rank<r>.pt`."""

from __future__ import annotations

from typing import Any

from ddptrain.checkpoint.formats.base import COMPRESSION_STATE
from ddptrain.errors import CheckpointError
from ddptrain.train.compression import Compression
from ddptrain.train.compression import attach as attach_compression
from ddptrain.train.sync.base import Loop, Sync


class EveryStep(Sync):
    """The default: gradients reduced every step (compressed when dist.grad_compression says so)."""

    compression: Compression | None = None

    def attach(self, loop: Loop) -> None:
        """dist.grad_compression's hook, sent through the step timer's (which the Trainer attached first)."""
        super().attach(loop)
        self.compression = attach_compression(self.cfg.dist, loop.ddp, loop.timer)

    def restore(self, shared: dict[str, Any], local: dict[str, Any] | None) -> dict[str, Any]:
        """PowerSGD continues from this rank's saved state (or starts fresh, said in a warning); shared as it is.
        CheckpointError (exit 2) for a DiLoCo run's checkpoint: its optimizer state is the outer optimizer's."""
        saved = shared["trainer"].get("sync")
        if saved is not None:
            raise CheckpointError(
                f"cannot resume without train.diloco from a checkpoint DiLoCo saved (every_steps="
                f"{saved['every_steps']}, {saved['groups']} group(s)): resume with the same train.diloco, or start a "
                "new folder from its global weights (model.init_from)"
            )
        if self.compression is not None:
            saved = local.get(COMPRESSION_STATE) if local is not None else None
            self.compression.load_state_dict(saved, shared["trainer"]["step"])
        return shared

    def checkpoint(self, shared: dict[str, Any], local: dict[str, Any]) -> None:
        """PowerSGD's error feedback: every rank's own."""
        compressed = self.compression.state_dict() if self.compression is not None else None
        if compressed is not None:
            local[COMPRESSION_STATE] = compressed
