"""The order a receiver tries its peers in (peer.spread): its own per set, the same at every
try, no peer everyone's first, and a peer gone moves only the receivers that ranked it first."""

from __future__ import annotations

from collections import Counter

from engramd.fleet.filling import FillingSets
from engramd.fleet.peer import PeerSource, spread
from engramd.fleet.trust import FleetKey

PEERS = [f"10.0.0.{i}:7077" for i in range(1, 5)]
RECEIVERS = [f"node-{i:03d}" for i in range(400)]


def test_each_receiver_tries_every_peer_once_in_an_order_of_its_own() -> None:
    orders = {r: spread(PEERS, "set-a", r) for r in RECEIVERS}
    for receiver, order in orders.items():
        assert sorted(order) == sorted(PEERS)
        assert spread(list(reversed(PEERS)), "set-a", receiver) == order  # input order moot
    assert len({tuple(o) for o in orders.values()}) > 12  # of the 24 orders there are


def test_no_peer_is_everyones_first_choice() -> None:
    firsts = [spread(PEERS, "set-a", r)[0] for r in RECEIVERS]
    first = Counter(firsts)
    # 400 receivers over 4 peers: about 100 each (binomial sd 8.7); deterministic hashing.
    assert set(first) == set(PEERS)
    assert all(60 <= n <= 140 for n in first.values()), first
    # Another set spreads the same receivers anew.
    again = [spread(PEERS, "set-b", r)[0] for r in RECEIVERS]
    moved = sum(a != b for a, b in zip(again, firsts, strict=True))
    assert moved > len(RECEIVERS) / 2


def test_a_peer_gone_moves_only_the_receivers_that_ranked_it_first() -> None:
    gone = PEERS[0]
    rest = PEERS[1:]
    for receiver in RECEIVERS:
        before = spread(PEERS, "set-a", receiver)
        after = spread(rest, "set-a", receiver)
        assert after == [p for p in before if p != gone]


def test_nodes_of_one_host_name_still_order_their_peers_each_their_own_way() -> None:
    """Cloned machines, or namespaces sharing one host name: a daemon's peer address is part of
    its identity, so members of a fleet still do not all ask the same peer first."""
    fleet = [f"10.0.1.{i}:7077" for i in range(1, 41)]
    firsts = Counter(
        PeerSource(fleet, FleetKey("t" * 32), 0, FillingSets(), own=me).addresses("set-a")[0]
        for me in fleet
    )
    assert len(firsts) > 10 and max(firsts.values()) < 10, firsts
