"""The log window: the steps committed since the last logged one, which the next logged step reports as one.

A logged step's record (metrics.jsonl, the resume certificate) covers every step since the previous logged
step: their mean loss, their time and, in the certificate, their samples. The window is part of the
training state, so that it survives what a process does not: a checkpoint carries it (a resume mid-window
logs the same window as an uninterrupted run), and so does the live state a joining replica group
receives in the in-place mode (a group that joined mid-window and comes to write the folder logs every
step since the last logged one, not only those it trained).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class LogWindow:
    """The steps since the last logged step: their summed loss (on the device), count and seconds.

    `trained` counts only the steps this process trained itself (what its own per-step sums, such as the
    custom metrics, cover); `steps` includes those it took over with a checkpoint or a peer's state.
    """

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.steps, self.trained, self.seconds = 0, 0, 0.0

    def add(self, loss: torch.Tensor, seconds: float) -> None:
        """One committed step of this process (no host read)."""
        self.loss += loss
        self.steps += 1
        self.trained += 1
        self.seconds += seconds

    def reset(self) -> None:
        """After a logged step: an empty window."""
        self.loss.zero_()
        self.steps, self.trained, self.seconds = 0, 0, 0.0

    def state_dict(self, per_rank: Callable[[torch.Tensor], list[float]]) -> dict[str, Any]:
        """{"steps", "seconds", "loss", "rank_losses"}: per_rank gives every rank's summed loss (a collective where
        the ranks' losses differ: every rank calls it, or none; an empty window reads nothing); loss is their mean."""
        losses = per_rank(self.loss) if self.steps else [0.0]
        return {"steps": self.steps, "seconds": self.seconds, "loss": sum(losses) / len(losses), "rank_losses": losses}

    def load_state_dict(self, state: dict[str, Any] | None, rank: int, world_size: int) -> None:
        """Continue the window of state_dict() (None: a checkpoint older than the window starts an empty one).

        At the world size that saved it each rank continues its own sum (the next logged mean is bit for bit the
        uninterrupted run's); at another one every rank continues from the ranks' mean (the same mean, rounded)."""
        self.reset()
        if state:
            losses = state.get("rank_losses") or []
            self.loss.fill_(float(losses[rank]) if len(losses) == world_size else float(state["loss"]))
            self.steps, self.seconds = int(state["steps"]), float(state["seconds"])
