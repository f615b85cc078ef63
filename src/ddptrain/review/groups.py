"""The replica groups of an in-place fault-tolerant run, for `ddptrain report`: who failed, restarted, was evicted.

In the in-place mode (train/sync/in_place.py) the job is one attempt: the groups train on while one of
them fails and comes back. What happened to each group is told by records of several writers:

* each group's start or resume record (`replica_group`, `restart_count`: the restarts of its launcher),
  and its end record (`replica_group`); a group killed outright writes none;
* the writing group's `quorum` events: the groups that `left` the quorum and `joined` it, and the steps
  discarded on the way;
* the joining group's `heal` event.

From them: a group that left and started again failed and restarted; one that started again without being
seen leaving (it was back before the others' next commit: their failed steps were discarded) failed too,
unless it had recorded an orderly end (a preemption); one that left and joined again without starting
again was evicted (it stopped answering: hung, or cut off) and rejoined; one that left for good without an
end record failed. Records of versions that did not name the group in its start record tell restarts only
(every start after the first quorum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddptrain.observe.endings import is_end_record
from ddptrain.review.story import Event, Story

_STARTS = ("start", "resume")
_FAILED = (None, "crashed", "stopped")  # how a group's process ended before it was started again: a failure


@dataclass
class GroupStory:
    """The events of the replica groups and their counts."""

    events: list[Event] = field(default_factory=list)
    failures: int = 0
    restarts: int = 0
    evictions: int = 0
    started: set[int] = field(default_factory=set)  # the groups whose start records name them
    members: set[int] = field(default_factory=set)  # every group seen in a quorum
    endings: dict[int, str] = field(default_factory=dict)  # group -> how its last process ended
    away: dict[int, dict[str, Any]] = field(default_factory=dict)  # group -> the quorum record it left in
    restarted: set[int] = field(default_factory=set)  # groups started again since they left
    quorums: int = 0
    untagged: int = 0  # restarts whose records do not name the group, not yet matched to a group's return
    ranks: Any = None  # the world size of the last quorum

    def start(self, r: dict[str, Any]) -> None:
        """A group's start or resume record: its first start, or a restart (after a failure, or an orderly end)."""
        group = r.get("replica_group")
        again = group in self.started if group is not None else self.quorums > 0
        if group is not None:
            self.started.add(group)
        if not again:
            return
        self.restarts += 1
        ended = self.endings.pop(group, None) if group is not None else None
        who = f"replica group {group}" if group is not None else "a replica group"
        count = f" (restart {r['restart_count']} of its launcher)" if r.get("restart_count") else ""
        step, when = int(r["step"]), _when(r)
        if ended in _FAILED:
            self.failures += 1
            if group is not None and group not in self.away:  # back before the others committed a step without it
                self.events.append(Event("group failed", step, when, f"{who} failed (its steps were discarded)"))
        why = "after a failure" if ended in _FAILED else f"after it {ended}"
        self.events.append(Event("group restart", step, when, f"{who} started again{count} {why}, from step {step}"))
        if group is not None:
            self.restarted.add(group)
        else:
            self.untagged += 1

    def quorum(self, r: dict[str, Any]) -> None:
        """The writing group's quorum record: groups that left (failed, evicted or ended) and joined."""
        self.quorums += 1
        self.members.update(r.get("groups", []))
        step, when, ranks = int(r["step"]), _when(r), r.get("world_size", "?")
        for g in r.get("left", []):
            self.away[g] = r
        for g in r.get("joined", []):
            left = self.away.pop(g, None)
            if left is not None and g not in self.restarted and self.untagged:
                self.untagged -= 1  # an older version's record: a restart that did not say whose it was
                self.restarted.add(g)
            if left is not None and g not in self.restarted:
                self.evictions += 1
                self.events.append(
                    Event("group evicted", int(left["step"]), _when(left), f"replica group {g} stopped answering")
                )
                what = f"replica group {g} rejoined without a restart (it had been evicted); {ranks} ranks"
            else:
                if left is not None:
                    self.events.append(
                        Event("group failed", int(left["step"]), _when(left), f"replica group {g} failed")
                    )
                what = f"replica group {g} joined; {ranks} ranks"
            self.restarted.discard(g)
            self.events.append(Event("group joined", step, when, what))
        if self.ranks is not None and ranks != self.ranks:
            self.events.append(Event("world size", step, when, f"world size {self.ranks} -> {ranks}"))
        self.ranks = ranks

    @property
    def groups(self) -> list[int]:
        """Every group the records name: in a start record or a quorum."""
        return sorted(self.started | self.members)

    def finish(self) -> None:
        """Groups still away at the end: failed (no end record), or ended as their end record says."""
        for g, left in sorted(self.away.items()):
            ended = self.endings.get(g)
            if g in self.restarted:
                kind, what = "group failed", "failed (started again, not back in the quorum)"
            elif ended in _FAILED:
                self.failures += 1
                kind, what = "group failed", "failed and did not come back"
            else:
                kind, what = "group left", f"left: it {ended}"
            self.events.append(Event(kind, int(left["step"]), _when(left), f"replica group {g} {what}"))
        self.events.sort(key=lambda e: (e.time, e.step))


def _when(r: dict[str, Any]) -> float:
    return float(r.get("time", 0.0))


def group_story(records: list[dict[str, Any]]) -> GroupStory:
    """The groups' failures, restarts, evictions and rejoins, from the records in file order (module docstring)."""
    story = GroupStory()
    for r in records:
        if r.get("kind") != "event":
            continue
        if r.get("event") in _STARTS:
            story.start(r)
        elif r.get("event") == "quorum":
            story.quorum(r)
        elif is_end_record(r) and r.get("replica_group") is not None:
            story.endings[int(r["replica_group"])] = str(r["event"])
    story.finish()
    return story


def in_place_groups(records: list[dict[str, Any]], story: Story) -> GroupStory | None:
    """For an in-place job (one attempt, quorum events): its groups' story, whose events join the job's; else None."""
    if not story.attempts[0].in_place:
        return None
    groups = group_story(records)
    story.events = sorted(story.events + groups.events, key=lambda e: (e.time, e.step))
    return groups


def group_lines(story: GroupStory, ending: str) -> list[str]:
    """Summary lines: the groups, their failures, restarts and evictions, how each one's last process ended, and
    how the job ended (`ending`: the last end record's words)."""
    named = f"{len(story.groups)} ({', '.join(map(str, story.groups))}); " if story.groups else ""
    line = (
        f"replica groups: {named}{story.failures} failure(s), {story.restarts} restart(s), "
        f"{story.evictions} eviction(s)"
    )
    if story.endings:
        line += "; last processes: " + ", ".join(f"group {g} {how}" for g, how in sorted(story.endings.items()))
    silent = sorted(story.started - set(story.endings))
    if story.endings and silent:
        line += f"; no end record from group(s) {', '.join(map(str, silent))} (killed, or still running)"
    return [line, f"job (in-place, one attempt): {ending}"]
