"""Streaming DiLoCo's fragments (train.diloco.fragments = P): the trainable parameters in P contiguous runs balanced
by size, and the steps each one syncs at: fragment p after steps where (step - offset_p) % H == 0, offset_p = p H // P
(staggered H / P apart, so each outer sync sends ~1/P of the bytes), and every fragment after the run's last step.

With train.diloco.delay_steps = tau > 0 (streaming DiLoCo's overlap) a fragment's sync *starts* at those steps and is
*applied* tau steps later; tau < H // P (the shortest gap between two fragments' syncs), so one sync is in flight at
a time. A sync that could not be applied by the last step is not started: the last step syncs every fragment not
applied at it, with no delay."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class StepPlan:
    """What the outer syncs do after one step: `apply` the fragments whose sync started `delay` steps before,
    `start` the syncs of `start` (applied `delay` steps later), and sync `now` at once."""

    apply: list[int]
    start: list[int]
    now: list[int]


def sync_plan(step: int, every: int, parts: int, delay: int, last: int) -> StepPlan:
    """The outer syncs after step `step` (from 1) with `delay` inner steps overlapping each (0: none, fragments_due's
    syncs at once; delay < every // parts)."""
    if delay == 0:
        return StepPlan([], [], fragments_due(step, every, parts, last))
    started = step - delay
    apply = fragments_due(started, every, parts, last) if started >= 1 else []
    if step == last:
        return StepPlan(apply, [], [p for p in range(parts) if p not in apply])
    return StepPlan(apply, fragments_due(step, every, parts, last) if step + delay <= last else [], [])
