"""The in-place mode's heal transport: torchft's, with the group's recipe shown before any state moves.

torchft's Manager fetches the donor's checkpoint metadata (its transport's `metadata()`, through the donor's
Manager server) before it receives a heal. Here that metadata also names the donor's replica group and recipe
(train/agreement.py: recipe_of), and the joiner refuses the heal, before it receives a byte, when the donor's
recipe is not its own: the donor trains in the job, so the joiner is the group of another recipe, and it
exits 2 (train/in_place.py). torchft reports the refusal as the step's error; the donor's send fails when
the joiner leaves, and the donor discards that step as for any peer lost mid-heal.

Imported only once torchft is (the mode's extra).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from torchft.checkpointing.transport import CheckpointTransport

State = dict[str, Any]


class RecipeRefused(RuntimeError):
    """The donor of a heal trains another recipe: nothing was received."""


class RecipeTransport(CheckpointTransport[State]):  # type: ignore[misc]  # torchft ships no type information
    """`inner` (torchft's PGTransport) whose metadata carries this group's id and recipe, checked by the joiner."""

    def __init__(self, inner: CheckpointTransport[State], group: int, recipe: str) -> None:
        self.inner, self.group, self.recipe = inner, group, recipe
        self.refused_by: int | None = None  # the donor's group when a heal was refused for its recipe (-1: unnamed)

    def metadata(self) -> str:
        """What a joiner reads of this group before a heal: its group, its recipe, the inner transport's metadata."""
        return json.dumps({"group": self.group, "recipe": self.recipe, "transport": self.inner.metadata()})

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: State, timeout: timedelta) -> None:
        """The donor's side, as the inner transport sends it."""
        self.inner.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        """As the inner transport."""
        self.inner.disallow_checkpoint()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> State:
        """The joiner's side: RecipeRefused, before anything is received, unless the donor's recipe is this group's."""
        try:
            donor = json.loads(metadata)
            group, recipe, inner = donor["group"], donor["recipe"], donor["transport"]
        except (ValueError, TypeError, KeyError):
            group, recipe, inner = -1, None, ""
        if recipe != self.recipe:
            self.refused_by = group if isinstance(group, int) else -1
            raise RecipeRefused(f"the donor (replica group {group}) trains another recipe")
        received: State = self.inner.recv_checkpoint(src_rank, inner, step, timeout)
        return received

    def shutdown(self, wait: bool = True) -> None:
        """As the inner transport."""
        self.inner.shutdown(wait)
