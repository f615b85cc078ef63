"""Who reads what at a shared load: the greedy size partition, and a checkpoint's files split over the ranks.

At a resume of W ranks each listed file is read and verified by exactly one rank, its owner; the
files every rank needs are then sent by their owner to the others (shared_load.py). The split is a
pure function of the manifest and W, so every rank computes the same one without a message, and
at a world size other than the writer's it is simply computed for the new W.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


def partition(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of sizes split into `parts` lists: largest first, each to the least loaded part.

    Deterministic (ties go to the lower index and the lower part), so every rank computes the same
    split from its own copy of the state; every index lands in exactly one part, in ascending order.
    """
    heap = [(0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (load + sizes[i], p))
    return [sorted(o) for o in out]


@dataclass(frozen=True)
class LoadPlan:
    """Each listed file's owner (the one rank that reads and verifies it) and which ranks need its content.

    shared: every rank needs it (its owner sends it to the others after every rank's verdict);
    private: only its owner needs it (a rank's own RNG streams); any other file is verified by its
    owner and dropped (another world size's RNG files: no rank resumes them, but a checkpoint is
    used only when every byte of it verified).
    """

    owner: dict[str, int]
    shared: frozenset[str]
    private: frozenset[str]

    def reads(self, rank: int) -> list[str]:
        """The files `rank` reads from storage and verifies, in name order."""
        return sorted(n for n, r in self.owner.items() if r == rank)

    def keeps(self, rank: int) -> set[str]:
        """Of those, the ones whose content `rank` keeps (to use or to send)."""
        return {n for n in self.reads(rank) if n in self.shared or n in self.private}


def plan_by_size(sizes: dict[str, int], private: dict[str, int], unused: set[str], world_size: int) -> LoadPlan:
    """A LoadPlan: each private file to its rank, every other file (shared, or unused) to a rank by
    partition() of their sizes, so every rank reads about 1/world_size of the bytes."""
    rest = sorted(n for n in sizes if n not in private)
    owner = {n: r for n, r in private.items() if n in sizes}
    alone = frozenset(owner)
    for rank, indices in enumerate(partition([sizes[n] for n in rest], world_size)):
        owner.update({rest[i]: rank for i in indices})
    return LoadPlan(owner, frozenset(n for n in rest if n not in unused), alone)
