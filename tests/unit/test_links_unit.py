"""The slow-link verdict over probed links (no processes needed; the probe itself runs in tests/cluster)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.observe.links import SLOW_LINK, Link, describe, judge


def _ring(hosts: list[str], seconds: dict[tuple[int, int], float], base: float = 0.002) -> list[Link]:
    """Both directions between ring neighbours, as the probe measures them."""
    w = len(hosts)
    pairs = {((r - 1) % w, r) for r in range(w)} | {((r + 1) % w, r) for r in range(w)}
    return [Link(s, d, seconds.get((s, d), base)) for s, d in sorted(pairs)]


def test_between_two_hosts_the_slow_direction_is_named() -> None:
    hosts = ["node1", "node2"]
    v = judge(_ring(hosts, {(1, 0): 0.2}), hosts)
    assert v.where == "the link node2 -> node1" and v.host is None
    assert [(x.src, x.dst) for x in v.slow] == [(1, 0)]
    assert "slow: the link node2 -> node1 (probe of 1 MiB: node2 -> node1 5.2 MB/s" in describe(v, hosts)


def test_the_host_all_slow_links_leave_from_is_named() -> None:
    hosts = ["node1", "node2", "node3"]
    v = judge(_ring(hosts, {(1, 2): 0.2, (1, 0): 0.25}), hosts)
    assert v.host == "node2" and v.where == "node2's outgoing traffic"
    v = judge(_ring(hosts, {(0, 2): 0.2, (1, 2): 0.25}), hosts)
    assert v.host == "node3" and v.where == "node3's incoming traffic"


def test_a_rank_that_started_its_probe_late_does_not_hide_the_slow_host() -> None:
    # node2 sends slowly; node1 was also late for one of its sends (a busy CPU): one slow link of
    # node1 is not all of them, so node2 is still the host named.
    hosts = ["node1", "node2", "node3"]
    v = judge(_ring(hosts, {(1, 2): 0.2, (1, 0): 0.25, (0, 2): 0.04}), hosts)
    assert v.host == "node2" and v.where == "node2's outgoing traffic"
    assert {(x.src, x.dst) for x in v.slow} == {(1, 2), (1, 0), (0, 2)}


def test_links_within_a_host_are_never_named() -> None:
    hosts = ["a", "a", "b", "b"]  # rank 0-1 on a, 2-3 on b; the a-internal link is slow, not a network link
    v = judge(_ring(hosts, {(0, 1): 0.5}), hosts)
    assert v.slow == [] and v.fastest is not None
    assert "found none slower than the others" in describe(v, hosts)
    one_host = judge(_ring(["a", "a", "a"], {(0, 1): 0.5}), ["a", "a", "a"])
    assert one_host.fastest is None and describe(one_host, ["a"] * 3).startswith("every rank is on one host")


def test_a_few_milliseconds_of_skew_is_not_a_slow_link() -> None:
    hosts = ["node1", "node2", "node3"]
    v = judge(_ring(hosts, {(1, 2): 0.004}, base=0.0005), hosts)  # 8x the fastest but only 3.5 ms more
    assert v.slow == []


# The slow host's links must be slower than SLOW_LINK (3x) times the others' worst jitter (1.5x): at
# factor 4 with jitter 1.5 on the others (2.7x) a host is within the threshold, and nothing is named.
@settings(max_examples=100, deadline=None)
@given(
    n_hosts=st.integers(3, 8),
    slow_host=st.integers(0, 7),
    factor=st.floats(SLOW_LINK * 1.5 * 1.05, 100.0),
    jitter=st.lists(st.floats(1.0, 1.5), min_size=16, max_size=16),
    outgoing=st.booleans(),
)
def test_one_slow_host_among_any_number_is_the_one_named(
    n_hosts: int, slow_host: int, factor: float, jitter: list[float], outgoing: bool
) -> None:
    slow_host %= n_hosts
    hosts = [f"node{i + 1}" for i in range(n_hosts)]
    links = [
        Link(x.src, x.dst, 0.01 * jitter[i % 16] * (factor if (x.src if outgoing else x.dst) == slow_host else 1.0))
        for i, x in enumerate(_ring(hosts, {}))
    ]
    v = judge(links, hosts)
    assert v.host == hosts[slow_host]
    assert v.where == f"{hosts[slow_host]}'s {'outgoing' if outgoing else 'incoming'} traffic"
