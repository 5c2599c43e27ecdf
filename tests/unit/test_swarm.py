"""A fill's schedule across the fleet (engramd/fleet/swarm.py): probes, shares that follow
rates, rarest pieces first, files last, busy sources resting, liars dropped, the end game,
and receivers spread over equal peers."""

from __future__ import annotations

from collections import Counter

import pytest

from engramd.fleet.swarm import BUSY_RETRY_S, MAX_FAILURES, MAX_REST_S, Schedule, Tier

MIB = 1 << 20


def schedule(pieces: int = 8, width: int = 4, receiver: str = "r") -> Schedule:
    return Schedule([MIB] * pieces, receiver, width)


def test_an_unmeasured_source_gets_one_probe_then_its_share_of_the_width() -> None:
    s = schedule()
    s.add("a", Tier.PEER, depth=8)
    (first,) = s.start(0.0)
    assert first[1] == "a"
    assert s.start(0.0) == []  # one probe until it answers
    s.landed(first[0], "a", 0.01)
    assert len(s.start(0.01)) == 4  # alone, it gets the whole width
    assert s.start(0.01) == []


def test_shares_follow_the_measured_rates() -> None:
    s = schedule(pieces=64, width=8)
    s.add("fast", Tier.PEER, depth=8)
    s.add("slow", Tier.PEER, depth=8)
    for piece, name in s.start(0.0):
        s.landed(piece, name, 0.01 if name == "fast" else 0.03)
    asked = Counter(name for _, name in s.start(1.0))
    assert asked == {"fast": 6, "slow": 2}  # 3:1 of the width


def test_the_rarest_piece_comes_first() -> None:
    s = schedule(pieces=4)
    s.add("a", Tier.PEER, depth=8, held=[0, 1, 2, 3])
    s.add("b", Tier.PEER, depth=8, held=[0, 1])
    started = dict((name, piece) for piece, name in s.start(0.0))
    assert started["a"] in (2, 3)  # only a holds 2 and 3
    assert started["b"] in (0, 1)


def test_a_peer_holding_some_is_asked_before_a_faster_one_holding_all() -> None:
    """The warm node (every piece, 1.5 times as fast) is asked only for what the filling peer
    cannot give once the filling peer has its share: its link is the fleet's scarce one."""
    s = schedule(pieces=6, width=8)
    s.add("warm", Tier.PEER, depth=8)
    s.add("filling", Tier.PEER, depth=4, held=range(5))
    probes = dict((name, piece) for piece, name in s.start(0.0))
    assert probes["warm"] == 5  # the one piece only it holds
    s.landed(probes["warm"], "warm", 0.01)
    s.landed(probes["filling"], "filling", 0.015)
    asked = Counter(name for _, name in s.start(1.0))
    assert asked == {"filling": 3, "warm": 1}  # its share of 8 is 3; the warm node the rest


def test_the_files_give_only_what_no_peer_holds_and_nothing_beside_a_store() -> None:
    s = schedule(pieces=4, width=8)
    s.add("a", Tier.PEER, depth=8, held=[0, 1])
    s.add("files", Tier.FILES, depth=8)
    from_files: list[int] = []
    for now in range(4):
        for piece, name in s.start(float(now)):
            if name == "files":
                from_files.append(piece)
            s.landed(piece, name, 0.01)
    assert s.done and sorted(from_files) == [2, 3]
    with_store = schedule(pieces=4, width=8)
    with_store.add("a", Tier.PEER, depth=8, held=[0, 1])
    with_store.add("store", Tier.STORE, depth=8)
    with_store.add("files", Tier.FILES, depth=8)
    assert all(name != "files" for _, name in with_store.start(0.0))
    with pytest.raises(ValueError, match="hold every piece"):
        with_store.add("files2", Tier.FILES, depth=8, held=[0])


def test_a_peer_that_verified_more_pieces_is_asked_for_them() -> None:
    s = schedule(pieces=2)
    s.add("a", Tier.PEER, depth=8, held=[])
    assert s.start(0.0) == []
    assert s.stuck()
    s.holds("a", [1])
    assert s.start(0.0) == [(1, "a")]
    assert s.stuck()  # piece 0: nobody


def test_a_busy_source_rests_longer_each_time_until_it_answers() -> None:
    s = schedule(pieces=4)
    s.add("a", Tier.PEER, depth=8)
    ((piece, _),) = s.start(0.0)
    now = 5.0
    rests = []
    for _ in range(12):
        s.busy(piece, "a", now)
        assert s.start(now) == []
        wake = s.wake()
        assert wake is not None and wake > now
        rests.append(wake - now)
        now = wake
        assert s.start(now) == [(piece, "a")]
    # Doubling from BUSY_RETRY_S up to MAX_REST_S, each jittered by x0.5 to x1.5.
    for k, rest in enumerate(rests):
        backoff = min(MAX_REST_S, BUSY_RETRY_S * 2**k)
        assert 0.5 * backoff <= rest < 1.5 * backoff
    s.landed(piece, "a", 0.01)
    assert s.sources["a"].busy == 0


def test_a_full_source_serving_ours_is_asked_for_what_it_takes_then_one_more() -> None:
    """A source whose slots are shared with other receivers: asked for no more at once than it
    took, without a rest, and for one more again after each piece that lands."""
    s = schedule(pieces=16, width=8)
    s.add("a", Tier.PEER, depth=4)
    ((probe, _),) = s.start(0.0)
    s.landed(probe, "a", 0.01)
    asked = s.start(0.01)
    assert len(asked) == 4
    first = asked[0][0]
    for piece, _ in asked[2:]:
        s.full(piece, "a")
    assert s.start(0.01) == []  # it takes 2 of ours at once now, and serves 2
    assert s.sources["a"].resting_until == 0.0
    s.landed(first, "a", 0.01)
    assert len(s.start(0.02)) == 2  # 3 at once: one more than it took
    assert s.sources["a"].took == 3


def test_a_liar_is_dropped_at_once_and_a_failing_source_after_its_failures() -> None:
    s = schedule(pieces=4, width=8)
    s.add("liar", Tier.PEER, depth=8, held=[0, 1, 2, 3])
    s.add("flaky", Tier.PEER, depth=8, held=[0, 1, 2, 3])
    s.add("honest", Tier.PEER, depth=8, held=[0, 1, 2, 3])
    probes = {name: piece for piece, name in s.start(0.0)}
    s.failed(probes["liar"], "liar", "piece 0's digest is not the attested one", lied=True)
    assert s.sources["liar"].dropped
    for k in range(MAX_FAILURES):
        piece = probes["flaky"] if k == 0 else next(p for p, n in s.start(float(k)) if n == "flaky")
        assert not s.sources["flaky"].dropped
        s.failed(piece, "flaky", "timed out")
    assert s.sources["flaky"].dropped == "timed out"
    s.landed(probes["honest"], "honest", 0.01)
    for _ in range(4):
        for piece, name in s.start(9.0):
            assert name == "honest"
            s.landed(piece, name, 0.01)
    assert s.done


def test_the_end_game_asks_a_faster_source_for_a_slow_sources_last_piece() -> None:
    s = schedule(pieces=3, width=4)
    s.add("fast", Tier.PEER, depth=8)
    s.add("slow", Tier.STORE, depth=8)
    probes = {name: piece for piece, name in s.start(0.0)}
    s.landed(probes["fast"], "fast", 0.01)
    # The last free piece, then the slow source's (every piece is requested): both fast.
    (last, _), duplicate = s.start(0.01)
    assert last not in probes.values()
    assert duplicate == (probes["slow"], "fast")
    s.landed(last, "fast", 0.01)
    assert s.landed(probes["slow"], "fast", 0.01) == ["slow"]
    assert s.done
    # The slow request ends later: moot, nothing changes.
    assert s.landed(probes["slow"], "slow", 5.0) == []
    assert s.sources["slow"].delivered == 0


def test_equal_peers_split_the_receivers_first_requests() -> None:
    firsts: Counter[str] = Counter()
    for k in range(400):
        s = schedule(pieces=16, receiver=f"node-{k}")
        for peer in "abcd":
            s.add(peer, Tier.PEER, depth=8)
        firsts[s.start(0.0)[0][1]] += 1
    assert set(firsts) == set("abcd")
    assert max(firsts.values()) < 2 * 400 / 4
