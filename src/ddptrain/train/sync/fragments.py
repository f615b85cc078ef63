"""Streaming DiLoCo's fragments (train.diloco.fragments = P): the trainable parameters in P contiguous runs balanced
by size, and the steps each one syncs at: fragment p after steps where (step - offset_p) % H == 0, offset_p = p H // P
(staggered H / P apart, so each outer sync sends ~1/P of the bytes), and every fragment after the run's last step."""

from __future__ import annotations


def split_fragments(sizes: list[int], parts: int) -> list[range]:
    """`parts` contiguous, non-empty runs of parameter indices covering every parameter once, cut where the running
    total of `sizes` comes closest to each k / parts of the whole (parts <= len(sizes))."""
    total, cuts, running = sum(sizes), [0], [0]
    for size in sizes:
        running.append(running[-1] + size)
    for k in range(1, parts):
        target = k * total / parts
        best = min(range(1, len(sizes)), key=lambda i: (abs(running[i] - target), i))
        cuts.append(min(max(best, cuts[-1] + 1), len(sizes) - (parts - k)))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def fragment_offsets(every: int, parts: int) -> list[int]:
    """Each fragment's offset in the interval of `every` steps: p * every // parts."""
    return [p * every // parts for p in range(parts)]


def fragments_due(step: int, every: int, parts: int, last: int) -> list[int]:
    """The fragments that sync after step `step` (from 1): those whose offset it meets, and all after `last`."""
    if step == last:
        return list(range(parts))
    return [p for p, offset in enumerate(fragment_offsets(every, parts)) if (step - offset) % every == 0]
