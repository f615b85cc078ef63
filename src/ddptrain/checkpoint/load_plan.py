"""Who reads what at a shared load: the greedy size partition, and a checkpoint's files split over the nodes.

At a resume of W ranks the listed files are split over the nodes (the ranks grouped by host), not
over the ranks: each file is read from storage on one node only, and there by every rank of that
node that needs it (they share the node's page cache, so a second read there is a memory copy, and
each rank verifies every byte it uses itself). The files every rank needs then travel from a rank of
the node that read them to the ranks of the other nodes (shared_load.py). The split is a pure
function of the manifest and the node of each rank, so every rank computes the same one without a
message, and at a world size other than the writer's it is simply computed for the new layout.
With every rank a node of its own this is the split of the files over the ranks; with one node,
every rank reads every file it needs and nothing travels.
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


def nodes_of(hosts: Sequence[str]) -> tuple[int, ...]:
    """Each rank's node index (0, 1, ... in order of first appearance) from every rank's host name."""
    index: dict[str, int] = {}
    return tuple(index.setdefault(h, len(index)) for h in hosts)


@dataclass(frozen=True)
class LoadPlan:
    """Which ranks read and verify each listed file, which ranks need its content, and who sends it.

    readers: the ranks that read a file from storage (all on one node, its owner) and verify it;
    shared: every rank needs it (the ranks of other nodes receive it from a reader, after every
    rank's verdict); private: only its one reader needs it (a rank's own RNG streams); any other
    file is verified by one rank and dropped (another world size's RNG files: no rank resumes
    them, but a checkpoint is used only when every byte of it verified). nodes: each rank's node.
    """

    readers: dict[str, frozenset[int]]
    shared: frozenset[str]
    private: frozenset[str]
    nodes: tuple[int, ...]

    def reads(self, rank: int) -> list[str]:
        """The files `rank` reads from storage (or its node's page cache) and verifies, in name order."""
        return sorted(n for n, ranks in self.readers.items() if rank in ranks)

    def keeps(self, rank: int) -> set[str]:
        """Of those, the ones whose content `rank` keeps (to use or to send)."""
        return {n for n in self.reads(rank) if n in self.shared or n in self.private}

    def routes(self) -> list[tuple[str, int, int]]:
        """(file, from rank, to rank) for every shared content a rank needs and did not read, in one order
        every rank computes alike (by file, then receiver): receiver r gets it from the reader whose place
        on its node is r's place on r's node (modulo that node's size), so the senders share the work."""
        members: dict[int, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            members.setdefault(node, []).append(rank)
        out = []
        for name in sorted(self.shared):
            readers = sorted(self.readers[name])
            for rank, node in enumerate(self.nodes):
                if rank not in self.readers[name]:
                    out.append((name, readers[members[node].index(rank) % len(readers)], rank))
        return out


def plan_by_size(sizes: dict[str, int], private: dict[str, int], unused: set[str], nodes: Sequence[int]) -> LoadPlan:
    """A LoadPlan for ranks on `nodes` (each rank's node index, in rank order).

    Each private file goes to its rank; every other file to a node by partition() of their sizes, so
    each node reads about 1/N of the bytes: a shared file is read there by every rank of the node, an
    unused one by one of them (partition() again, within the node)."""
    layout = tuple(nodes)
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(layout):
        members.setdefault(node, []).append(rank)
    groups = [members[node] for node in sorted(members)]
    readers = {n: frozenset([r]) for n, r in private.items() if n in sizes}
    rest = sorted(n for n in sizes if n not in private)
    for ranks, indices in zip(groups, partition([sizes[n] for n in rest], len(groups)), strict=True):
        names = [rest[i] for i in indices]
        readers.update({n: frozenset(ranks) for n in names if n not in unused})
        spare = [n for n in names if n in unused]
        for rank, picked in zip(ranks, partition([sizes[n] for n in spare], len(ranks)), strict=True):
            readers.update({spare[i]: frozenset([rank]) for i in picked})
    return LoadPlan(
        readers, frozenset(n for n in rest if n not in unused), frozenset(readers) - frozenset(rest), layout
    )
