"""The eviction watch's reading of torchft 0.2.0's Lighthouse status page (train/peer_watch.py), in-process."""

from __future__ import annotations

from ddptrain.train.peer_watch import Heartbeat, group_of, live_outsiders, parse_heartbeats, silent_groups

PAGE = """<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat
    old
  ">
    g1:6cc718ea-b6af-42f4-8693-3bb968ceb3ec: seen 2.509563697s ago
  </li>
  <li class="heartbeat

  ">
    g0:2b675b5e-13ef-4fa6-b40f-eeb690ea549e: seen 35.519056ms ago
  </li>
  <li class="heartbeat
    old
  ">
    g2:0d1e: seen 1.2s ago
  </li>
</ul>"""


def test_heartbeats_are_read_with_their_age_and_the_lighthouses_verdict() -> None:
    beats = parse_heartbeats(PAGE)
    assert beats["g1:6cc718ea-b6af-42f4-8693-3bb968ceb3ec"].old
    assert abs(beats["g1:6cc718ea-b6af-42f4-8693-3bb968ceb3ec"].age_s - 2.5096) < 1e-3
    assert not beats["g0:2b675b5e-13ef-4fa6-b40f-eeb690ea549e"].old
    assert abs(beats["g0:2b675b5e-13ef-4fa6-b40f-eeb690ea549e"].age_s - 0.0355) < 1e-4
    assert parse_heartbeats("<html>another page</html>") == {}


def test_only_participants_silent_long_enough_and_old_are_evicted_never_this_group() -> None:
    beats = parse_heartbeats(PAGE)
    ids = list(beats)
    eviction = silent_groups(beats, ids, own=0)
    assert eviction is not None and eviction.groups == [1]  # g2 is old but silent for less than SILENT_S
    assert silent_groups(beats, ids, own=1) is None  # a group never evicts itself
    assert silent_groups(beats, [ids[1], ids[2]], own=0) is None  # g1 not in this step's quorum: nobody to evict
    assert (group_of("g12:abc"), group_of("replica-3")) == (12, None)


def test_outsiders_are_the_live_groups_without_a_replica_in_the_quorum() -> None:
    """DiLoCo's first quorum waits for these (train/sync/in_place.py): live heartbeats only, by group id, so a
    restarted group's old incarnation (another replica id of a group in the quorum) is no outsider."""
    beats = parse_heartbeats(PAGE)
    g0 = "g0:2b675b5e-13ef-4fa6-b40f-eeb690ea549e"
    assert live_outsiders(beats, ["g1:6cc718ea-b6af-42f4-8693-3bb968ceb3ec"], own=1) == [0]
    assert live_outsiders(beats, [g0], own=0) == []  # g1 and g2 are old: gone
    beats["g3:new"] = beats["g4:new"] = beats["g0:restarted"] = Heartbeat(0.01, False)
    assert live_outsiders(beats, [g0, "g3:new"], own=0) == [4]
    assert live_outsiders(beats, ["g3:new"], own=3) == [0, 4]
    assert live_outsiders({}, [g0], own=1) == []  # an unreadable page: nobody is waited for
