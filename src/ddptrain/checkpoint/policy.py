"""When to save and what a failed save means: the checkpoint policy the Trainer asks, not decides.

    due(step, final, stop)      a save at this step? (every ckpt.every_steps, the final step, a stop)
    judge(result)               a failed save stops the run (on_error=stop) or is remembered (continue)
    final_retry_needed(step)    the last save failed: retry it once at the end
    require_final(step)         the final state is committed, or CheckpointSaveError naming the newest safe step

Every rank sees the same agreed SaveResults, so every rank reaches the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddptrain.config import CkptConfig
from ddptrain.errors import CheckpointSaveError


@dataclass
class SaveResult:
    """How a save went, as all ranks agreed."""

    step: int
    ok: bool
    error: str | None
    blocked_s: float  # time the training loop waited
    total_s: float  # time until committed (or failed)
    path: Path | None
    lease_lost: str | None = None  # not committed because another run took the folder's lease: who holds it


class SavePolicy:
    """ckpt.every_steps and ckpt.on_error, applied to the agreed results of saves."""

    def __init__(self, cfg: CkptConfig, resumed_step: int | None = None) -> None:
        self.cfg = cfg
        self.newest_committed = resumed_step  # the newest step known to be safely on disk
        self.last_failure: SaveResult | None = None

    def due(self, step: int, final: bool = False, stop: bool = False) -> bool:
        """Whether every rank saves after `step`."""
        every = self.cfg.every_steps
        return final or stop or bool(every and step % every == 0)

    def judge(self, result: SaveResult) -> None:
        """Record an agreed result; a failure raises CheckpointSaveError when ckpt.on_error=stop."""
        if result.ok:
            self.newest_committed = result.step
            if self.last_failure is not None and self.last_failure.step <= result.step:
                self.last_failure = None
            return
        self.last_failure = result
        if self.cfg.on_error == "stop":
            raise CheckpointSaveError(f"checkpoint at step {result.step} failed: {result.error}")

    def final_retry_needed(self, step: int) -> bool:
        """True when the state at `step` is not committed because its save failed."""
        return self.newest_committed != step and self.last_failure is not None

    def require_final(self, step: int) -> None:
        """CheckpointSaveError unless the state at `step` is committed (what a finished run promises)."""
        if self.newest_committed == step:
            return
        safe = (
            f"step {self.newest_committed}"
            if self.newest_committed is not None
            else "none (no checkpoint was committed)"
        )
        why = f": {self.last_failure.error}" if self.last_failure is not None else ""
        raise CheckpointSaveError(
            f"the final state at step {step} could not be committed{why}; the newest safe checkpoint is {safe}"
        )
