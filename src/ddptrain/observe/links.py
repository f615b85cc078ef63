"""Which link is slow: a point-to-point probe between neighbouring ranks.

The straggler check can tell that the gradient all-reduce got slower for everyone, not whose link
it is: a ring all-reduce runs at the pace of its slowest link. When the check confirms slow
communication (every rank reaches that verdict at the same check, from the same gathered numbers,
so all take part), each rank sends PROBE_BYTES to the next rank while receiving from the previous
one, then (at three ranks or more) the other way round; the time each receive took is that link's.
Links between ranks of one host are measured but never named; a cross-host link is slow when it
takes SLOW_LINK times the fastest cross-host link and COMM_FLOOR_S more. A host is named when the
fastest of its outgoing (or incoming) links is that much slower than the other hosts' fastest ones;
between two hosts the slow direction is named.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddptrain.dist import DistContext

PROBE_BYTES = 1 << 20
ROUNDS = 3  # each link's time is the fastest of three rounds, each begun together: a rank late once is not a slow link
SLOW_LINK = 3.0
COMM_FLOOR_S = 0.005


@dataclass(frozen=True)
class Link:
    """One direction between two ranks and the seconds PROBE_BYTES took over it."""

    src: int
    dst: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        """Throughput of the probe over this link."""
        return PROBE_BYTES / 1e6 / self.seconds if self.seconds > 0 else float("inf")


def _exchange(ctx: DistContext, send_to: int, recv_from: int, out: torch.Tensor, inp: torch.Tensor) -> float:
    dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.group)  # start together
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    t0 = time.perf_counter()
    send = dist.isend(out, send_to, group=ctx.group)
    recv = dist.irecv(inp, recv_from, group=ctx.group)
    if send is None or recv is None:  # only a rank outside the group gets no request
        raise RuntimeError("the link probe ran on a rank outside the training group")
    recv.wait()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)  # NCCL's wait() orders streams; the host must see the bytes
    seconds = time.perf_counter() - t0
    send.wait()
    return seconds


def probe(ctx: DistContext) -> list[Link]:
    """All ranks, together: time the link into every rank from each ring neighbour (gathered)."""
    world, rank = ctx.world_size, ctx.rank
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    out = torch.ones(PROBE_BYTES, dtype=torch.uint8, device=ctx.device)
    inp = torch.empty_like(out)
    directions = [(nxt, prev)] if world == 2 else [(nxt, prev), (prev, nxt)]  # at 2 ranks one round trip is both
    mine = [min(_exchange(ctx, to, frm, out, inp) for _ in range(ROUNDS)) for to, frm in directions]
    local = torch.tensor(mine, dtype=torch.float64, device=ctx.device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=ctx.group)
    links = []
    for r, times in enumerate(t.tolist() for t in gathered):
        links.append(Link((r - 1) % world, r, times[0]))
        if world > 2:
            links.append(Link((r + 1) % world, r, times[1]))
    return links


@dataclass(frozen=True)
class LinkVerdict:
    """The slow cross-host links and where they point."""

    slow: list[Link]
    fastest: Link | None
    where: str = ""  # "" when no link is slower than the others
    host: str | None = None  # the one host all slow links leave from or arrive at (not between two hosts)


def _slow_end(links: list[Link], hosts: list[str], end: str) -> tuple[str, float] | None:
    """The host whose fastest outgoing (end="src") or incoming ("dst") link is slow against the other
    hosts' fastest ones, with that ratio; a rank that started its probe late makes one link slow, not
    every link of its host."""
    best: dict[str, float] = {}
    for x in links:
        h = hosts[getattr(x, end)]
        best[h] = min(best.get(h, x.seconds), x.seconds)
    found = None
    for h, seconds in best.items():
        others = [v for k, v in best.items() if k != h]
        ref = sorted(others)[len(others) // 2]
        if seconds > SLOW_LINK * ref and seconds > ref + COMM_FLOOR_S:
            ratio = seconds / ref if ref > 0 else float("inf")
            if found is None or ratio > found[1]:
                found = (h, ratio)
    return found


def judge(links: list[Link], hosts: list[str]) -> LinkVerdict:
    """Which cross-host links are slow, and the host (or, between two hosts, the direction) they share."""
    cross = [x for x in links if hosts[x.src] != hosts[x.dst]]
    if not cross:
        return LinkVerdict([], None)
    fastest = min(cross, key=lambda x: x.seconds)
    slow = sorted(
        (x for x in cross if x.seconds > SLOW_LINK * fastest.seconds and x.seconds > fastest.seconds + COMM_FLOOR_S),
        key=lambda x: -x.seconds,
    )
    if not slow:
        return LinkVerdict([], fastest)
    if len(set(hosts)) == 2:
        worst = slow[0]
        return LinkVerdict(slow, fastest, f"the link {hosts[worst.src]} -> {hosts[worst.dst]}")
    sender, receiver = _slow_end(cross, hosts, "src"), _slow_end(cross, hosts, "dst")
    if sender is not None and (receiver is None or sender[1] >= receiver[1]):
        return LinkVerdict(slow, fastest, f"{sender[0]}'s outgoing traffic", sender[0])
    if receiver is not None:
        return LinkVerdict(slow, fastest, f"{receiver[0]}'s incoming traffic", receiver[0])
    return LinkVerdict(slow, fastest, "several links: " + ", ".join(f"{hosts[x.src]} -> {hosts[x.dst]}" for x in slow))


def describe(verdict: LinkVerdict, hosts: list[str]) -> str:
    """One clause for the slow-communication warning."""
    if verdict.fastest is None:
        return "every rank is on one host (no network link to probe)"
    if not verdict.slow:
        return (
            f"a probe of every link between hosts found none slower than the others (fastest "
            f"{verdict.fastest.mb_per_s:.0f} MB/s): the slowdown is shared"
        )
    worst = verdict.slow[0]
    return (
        f"slow: {verdict.where} (probe of {PROBE_BYTES >> 20} MiB: {hosts[worst.src]} -> {hosts[worst.dst]} "
        f"{worst.mb_per_s:.1f} MB/s, fastest link {hosts[verdict.fastest.src]} -> {hosts[verdict.fastest.dst]} "
        f"{verdict.fastest.mb_per_s:.0f} MB/s)"
    )
